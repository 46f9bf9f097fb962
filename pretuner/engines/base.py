"""What `tune/` asks an engine: its command, its log's verdict on a launch, its deployment.

One module per engine holds that engine's facts (ARCHITECTURE.md): the command that starts it,
the flags and variables it reads, the meaning of its log lines, and how a tuned KV budget is
expressed to it. The r0.1 engine (`mindspore_r01`) sizes its KV cache from two environment
variables; the V1 family (`vllm_v1`) profiles memory itself and takes a pinned budget through
`--kv-cache-memory-bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pretuner.tune.settings import LaunchCommand, LaunchSettings


class Family(str, Enum):
    R01 = "r01"  # vLLM-MindSpore r0.1: ASCEND_TOTAL_MEMORY_GB / vLLM_MODEL_MEMORY_USE_GB
    V1 = "v1"  # vLLM's V1 engine: own profiling, --kv-cache-memory-bytes


@dataclass(frozen=True, slots=True)
class Target:
    """Where and as what one launch serves."""

    model: str  # what the server loads (a path or an id it can resolve)
    served_name: str
    host: str
    port: int
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Deployment:
    """How a tuned configuration is written for this engine: its flags and environment."""

    flags: tuple[tuple[str, str | None], ...]  # ("--kv-cache-memory-bytes", "64073940992")
    env: dict[str, str]
    notes: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        out: list[str] = []
        for flag, value in self.flags:
            out += [flag] if value is None else [flag, value]
        return out


class Engine(Protocol):
    name: str  # "vllm", "vllm-ascend", "vllm-mindspore", "vllm-cpu", "vllm-mindspore-r01"
    family: Family
    device_kind: str  # the DeviceReader kind: "cuda", "ascend", "cpu", "emulated"
    simulated: bool  # the emulated server stands in for the real one

    def command(self, settings: LaunchSettings, target: Target) -> LaunchCommand:
        """The launch's argv and environment (pure)."""
        ...

    def deploy(self, settings: LaunchSettings) -> Deployment:
        """The flags and environment that start production with these settings."""
        ...
