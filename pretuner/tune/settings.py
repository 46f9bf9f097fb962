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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["purpose"] = self.purpose.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchSettings:
        fields = dict(data)
        fields["purpose"] = Purpose(fields["purpose"])
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str]  # only what pretuner sets on top of the inherited environment

    def shell_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


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
    if nodes > 1:
        argv += ["--distributed-executor-backend", "ray"]
    env = {
        "GLOG_v": "1",  # MindSpore prints the pool dump at INFO only
        "ASCEND_TOTAL_MEMORY_GB": str(s.card_gib),
        "vLLM_MODEL_MEMORY_USE_GB": str(s.model_use_gib),
    }
    env.update(extra_env or {})
    return LaunchCommand(argv=argv, env=env)


_SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL)", re.I)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """The environment as recorded: values of secret-looking names replaced."""
    return {k: ("<redacted>" if _SECRET.search(k) else v) for k, v in env.items()}
