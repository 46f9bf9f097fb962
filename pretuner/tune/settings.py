"""What one launch is started with, and how its command line and environment are built.

Pure: `build_launch` returns data (argv, env); nothing is started here.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from pretuner.redact import redact_argv, redact_env


class Backend(str, Enum):
    SIM = "sim"
    VLLM_MINDSPORE = "vllm-mindspore"
    MINDSPORE_CPU = "mindspore-cpu"


class Purpose(str, Enum):
    PRERUN = "prerun"  # one max-length request, max-num-seqs 1 (seed 003 §3.2.1)
    VALIDATE = "validate"  # max-num-seqs concurrent max-length requests with the tuned values


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """The values that vary between launches of one run."""

    purpose: Purpose
    card_gib: int
    util: float
    model_use_gib: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    tp: int
    pp: int = 1
    kv_cache_dtype: str = "auto"  # pretuner's name (kvmath.KV_DTYPES)
    chunked_prefill: bool = False  # prefill in chunks of max_num_batched_tokens
    # V1 engines: the KV cache pinned with --kv-cache-memory-bytes; None lets the engine
    # profile (--gpu-memory-utilization decides).
    kv_cache_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["purpose"] = self.purpose.value
        return data

    @property
    def batched_policy(self) -> str:
        if self.chunked_prefill:
            return f"chunked prefill, {self.max_num_batched_tokens:,}-token steps"
        return "whole-prompt prefill steps"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchSettings:
        fields = dict(data)
        fields["purpose"] = Purpose(fields["purpose"])
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str]  # only what pretuner sets on top of the inherited environment

    def redacted(self) -> LaunchCommand:
        """The command as it may be stored or printed: secret values are `<redacted>`."""
        return LaunchCommand(argv=redact_argv(self.argv), env=redact_env(self.env))

    def shell_line(self) -> str:
        """The command for people to read (never run by pretuner), secrets redacted."""
        cmd = self.redacted()
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        return f"{env} {shlex.join(cmd.argv)}".strip()


R01_COMMAND = ("python3", "-m", "vllm_mindspore.entrypoints", "vllm.entrypoints.openai.api_server")
V03_COMMAND = ("vllm-mindspore", "serve")
# The emulated server behind the same kind of wrapper as r0.1 (a child via subprocess.run), so
# the process handling meets the real trap.
SIM_COMMAND = (sys.executable, "-m", "pretuner.sim", "launch", "vllm.entrypoints.openai.api_server")


def default_serve_command(backend: Backend, engine_version: str | None) -> tuple[list[str], bool]:
    """The server command for a backend, and whether the model goes as `--model` (r0.1 style)."""
    if backend is Backend.SIM:
        return list(SIM_COMMAND), True
    if backend is Backend.MINDSPORE_CPU:
        return [sys.executable, "-m", "pretuner.backends.mindspore_cpu", "serve"], True
    if engine_version is not None and _version_tuple(engine_version) >= (0, 3):
        return list(V03_COMMAND), False
    return list(R01_COMMAND), True


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def build_launch(
    s: LaunchSettings,
    *,
    base_command: list[str],
    model_as_flag: bool,
    model: str,
    served_name: str,
    host: str,
    port: int,
    nodes: int = 1,
    extra_env: dict[str, str] | None = None,
) -> LaunchCommand:
    """The exact argv and environment of one launch."""
    argv = list(base_command)
    argv += ["--model", model] if model_as_flag else [model]
    argv += [
        "--host", host,
        "--port", str(port),
        "--served-model-name", served_name,
        "--max-model-len", str(s.max_model_len),
        "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens),
        "--gpu-memory-utilization", f"{s.util:g}",
        "--block-size", str(s.block_size),
        "--tensor-parallel-size", str(s.tp),
    ]  # fmt: skip
    if s.pp > 1:
        argv += ["--pipeline-parallel-size", str(s.pp)]
    argv += engine_prefill_flags(s.max_model_len, s.chunked_prefill)
    dtype = server_kv_cache_dtype(s.kv_cache_dtype)
    if dtype is not None:
        argv += ["--kv-cache-dtype", dtype]
    if nodes > 1:
        argv += ["--distributed-executor-backend", "ray"]
    env = {
        "GLOG_v": "1",  # MindSpore prints the pool dump at INFO only
        "ASCEND_TOTAL_MEMORY_GB": str(s.card_gib),
        "vLLM_MODEL_MEMORY_USE_GB": str(s.model_use_gib),
    }
    env.update(extra_env or {})
    return LaunchCommand(argv=argv, env=env)


# vLLM 0.6 turns chunked prefill on by default above this max_model_len.
CHUNKED_BY_DEFAULT_ABOVE = 32768
# pretuner's KV dtype names -> the server's `--kv-cache-dtype` (None: the model's own dtype).
# MindSpore's int8 MLA layout (int8 latent, bf16 rope) is what vLLM-MindSpore's int8 means for
# an MLA model.
_SERVER_KV_DTYPE: dict[str, str | None] = {
    "auto": None, "bf16": None, "fp16": None, "int8": "int8", "int8-mla": "int8", "fp8": "fp8",
}


def server_kv_cache_dtype(kv_cache_dtype: str) -> str | None:
    """The `--kv-cache-dtype` value the server takes, or None to leave the flag out."""
    return _SERVER_KV_DTYPE.get(kv_cache_dtype, kv_cache_dtype)


def chunked_prefill_flag(max_model_len: int, chunked: bool) -> bool | None:
    """`--enable-chunked-prefill`'s value whenever the engine's default differs from the
    policy, else None (leave the flag out)."""
    if chunked:
        return True
    if max_model_len > CHUNKED_BY_DEFAULT_ABOVE:
        return False
    return None


def engine_prefill_flags(max_model_len: int, chunked: bool) -> list[str]:
    flag = chunked_prefill_flag(max_model_len, chunked)
    if flag is None:
        return []
    return ["--enable-chunked-prefill"] if flag else ["--enable-chunked-prefill", "False"]
