"""What `tune/` asks an engine: its command, its log's verdict on a launch, its deployment.

One module per engine holds that engine's facts (ARCHITECTURE.md): the command that starts it,
the flags and variables it reads, the meaning of its log lines, and how a tuned KV budget is
expressed to it. The r0.1 engine (`mindspore_r01`) sizes its KV cache from two environment
variables; the V1 family (`vllm_v1`) profiles memory itself and takes a pinned budget through
`--kv-cache-memory-bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

from pretuner.launch.command import LaunchCommand as LaunchCommand
from pretuner.launch.sampler import Phase as Phase


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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchSettings:
        fields = dict(data)
        fields["purpose"] = Purpose(fields["purpose"])
        return cls(**fields)


class Family(str, Enum):
    R01 = "r01"  # vLLM-MindSpore r0.1: ASCEND_TOTAL_MEMORY_GB / vLLM_MODEL_MEMORY_USE_GB
    V1 = "v1"  # vLLM's V1 engine: own profiling, --kv-cache-memory-bytes


# vLLM's API server (both families): started with a key, its /v1 routes want
# `Authorization: Bearer KEY`; `--api_key` is the same flag, the variable its fallback.
API_KEY_FLAGS = ("--api-key", "--api_key")
API_KEY_VAR = "VLLM_API_KEY"


def api_key(argv: Sequence[str]) -> str | None:
    """The key a server started with `argv` wants from its clients (the last one given)."""
    key = None
    for word, after in zip(argv, [*argv[1:], None], strict=True):
        name, eq, value = word.partition("=")
        if name in API_KEY_FLAGS:
            key = value if eq else after
    return key


@dataclass(frozen=True, slots=True)
class Target:
    """Where and as what one launch serves."""

    model: str  # what the server loads (a path or an id it can resolve)
    served_name: str
    host: str
    port: int
    extra_env: dict[str, str] = field(default_factory=dict)


Flag = tuple[str, str | None]  # a server flag and its value (None: a switch)
KV_FLAG = "--kv-cache-memory-bytes"  # the pinned KV cache: V1 engines, vLLM-MindSpore 0.5+


@dataclass(frozen=True, slots=True)
class Deployment:
    """How a tuned configuration is written for this engine: its flags and environment."""

    flags: tuple[Flag, ...]  # ("--kv-cache-memory-bytes", "64073940992")
    env: dict[str, str]
    notes: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        return [word for flag, value in self.flags for word in flag_words(flag, value)]


def batch_flags(s: LaunchSettings) -> list[Flag]:
    """The length and batch flags every engine is started with, in the order it is given them."""
    return [("--max-model-len", str(s.max_model_len)), ("--max-num-seqs", str(s.max_num_seqs)),
            ("--max-num-batched-tokens", str(s.max_num_batched_tokens))]


def launch_command(head: Sequence[str], target: Target, flags: Sequence[Flag],
                   env: dict[str, str]) -> LaunchCommand:
    """One launch: `head` (the server command and its model), the launch's own address and
    served name, then `flags`; the key its clients send is the one the argv gives."""
    argv = [*head, "--host", target.host, "--port", str(target.port),
            *flag_words("--served-model-name", target.served_name),
            *(word for flag, value in flags for word in flag_words(flag, value))]
    return LaunchCommand(argv=argv, env=env, bearer=api_key(argv))


def flag_words(flag: str, value: str | None) -> list[str]:
    """A flag and its value as argv words; a value that starts with "-" (a model folder named
    `-rf`) joined by "=", else the engine's parser would read it as a flag of its own."""
    if value is None:
        return [flag]
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


class Engine(Protocol):
    """An engine as the pipeline sees it: r0.1 (`mindspore_r01.R01Engine`: vLLM-MindSpore
    r0.1, its emulated card, MindSpore on CPU) or V1 (`vllm_v1.V1Engine`: vLLM, vllm-ascend,
    vLLM-MindSpore 0.3+, vLLM on CPU, each real or emulated)."""

    @property
    def name(self) -> str: ...  # the registry's name: "vllm", "sim", "vllm-mindspore-r01"...
    @property
    def family(self) -> Family: ...  # which tuning method sizes its KV cache
    @property
    def device(self) -> str: ...  # what it runs on, emulated or not: cuda, ascend, cpu
    @property
    def device_kind(self) -> str: ...  # the DeviceReader kind: cuda, ascend, cpu, emulated
    @property
    def simulated(self) -> bool: ...  # the emulator stands in for the real server
    @property
    def server(self) -> str: ...  # what serves, in the report's words
    @property
    def ray_resource(self) -> str: ...  # what one rank holds on a Ray cluster
    @property
    def serve_cmd(self) -> tuple[str, ...]: ...  # the user's own start command, if any

    # What plan asks of the engine before any launch.
    budget_in_whole_gib: ClassVar[bool]  # told its budget in whole GiB (r0.1's model-use)
    pp_across_nodes: ClassVar[bool]  # its method shards stages across nodes
    takes_weights_flags: ClassVar[bool]  # takes quantization and offload flags

    @classmethod
    def card_words(cls, card_gib: int, card_source: str, device_kind: str) -> str:
        """The devices a run's --card named, in this engine's unit (the report's words)."""
        ...

    def cache_state(self, env: Mapping[str, str]) -> str:
        """The engine's compile cache as a launch starts, in the report's words."""
        ...

    def command(self, settings: LaunchSettings, target: Target) -> LaunchCommand:
        """The launch's argv and environment (pure)."""
        ...

    def deploy(self, settings: LaunchSettings) -> Deployment:
        """The flags and environment that start a launch with these settings."""
        ...

    def production(self, settings: LaunchSettings) -> Deployment:
        """What starts production with the settings the launches proved (deploy/ renders it):
        the launch's own flags, less what only the tuner needs, for the engine's version."""
        ...
