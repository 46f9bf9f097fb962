"""The typed events the per-line parser returns, and `Located`: an event with its writer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pretuner.logscan.pooldump import PartialPoolDump, PoolDump, PoolDumpHeader


class OomKind(str, Enum):
    """What ran out, which decides the tuner's fallback."""

    DEVICE_OOM = "device_oom"  # an allocation failed on the card (weights or activations)
    KV_BLOCKS_EXHAUSTED = "kv_blocks_exhausted"  # nothing left for KV cache blocks
    MAX_DEVICE_MEMORY_RANGE = "max_device_memory_range"  # max_device_memory above free memory
    MAX_MODEL_LEN_TOO_LARGE = "max_model_len_too_large"  # one sequence does not fit the KV cache


class MemoryStatKind(str, Enum):
    """The figures of MindSpore's deinit statistics block."""

    DEVICE = "device"
    MINDSPORE_USED = "mindspore_used"
    USED_PEAK = "used_peak"  # without fragments
    ACTUAL_PEAK = "actual_peak"  # with fragments


@dataclass(frozen=True, slots=True)
class DeviceMemoryInit:
    """MindSpore's memory-adapter init line (`Device MOC Size:...`; HBM on <= 2.4)."""

    memory_kind: str  # "MOC" or "HBM"
    device_mib: int | None
    device_free_mib: int | None
    reserved_other_mib: int | None
    user_define_mib: int | None
    mindspore_used_mib: int | None


@dataclass(frozen=True, slots=True)
class MemoryStat:
    """One figure of the deinit statistics block."""

    stat: MemoryStatKind
    value_mib: int


@dataclass(frozen=True, slots=True)
class OomEvent:
    """An out-of-memory or KV-exhaustion report, with whatever figures the text carries."""

    kind: OomKind
    message: str
    alloc_bytes: int | None = None
    kernel: str | None = None
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    estimated_max_model_len: int | None = None
    free_device_gib: float | None = None
    max_device_memory_limit_mib: float | None = None
    max_device_memory_requested_mib: float | None = None


@dataclass(frozen=True, slots=True)
class LoadingStarted:
    """vLLM announces that it starts loading weights."""


@dataclass(frozen=True, slots=True)
class ModelLoaded:
    """vLLM / vllm-ascend weight loading figures (vllm-ascend's "GB" are GiB)."""

    weights_gib: float
    seconds: float | None


@dataclass(frozen=True, slots=True)
class AvailableKvMemory:
    """`Available KV cache memory: X GiB` (may be negative)."""

    gib: float


@dataclass(frozen=True, slots=True)
class AvailableMemory:
    """vllm-ascend <= 0.13: `Available memory: B, total memory: T` in raw bytes."""

    available_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class KvCacheSize:
    """`GPU KV cache size: 645,120 tokens`."""

    tokens: int


@dataclass(frozen=True, slots=True)
class MaxConcurrency:
    """`Maximum concurrency for 4,096 tokens per request: 265.25x`."""

    tokens_per_request: int
    concurrency: float


@dataclass(frozen=True, slots=True)
class KvReserved:
    """vLLM V0: `the rest of the memory reserved for KV Cache is 1.57GiB.`"""

    gib: float


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """vLLM V0: `# GPU blocks: N, # CPU blocks: M` (`# npu blocks` on Ascend)."""

    device_blocks: int
    cpu_blocks: int


@dataclass(frozen=True, slots=True)
class PromptIgnored:
    """vLLM V0's scheduler dropped a prompt: it never ran, and its reply is empty.

    `limit` is None for `exceeds the capacity of block_manager` (the KV cache cannot hold it
    beside the 1 % block watermark), else the prompt limit it exceeded.
    """

    prompt_tokens: int
    limit: int | None


LogEvent = (
    PoolDump
    | PartialPoolDump
    | PoolDumpHeader
    | DeviceMemoryInit
    | MemoryStat
    | OomEvent
    | LoadingStarted
    | ModelLoaded
    | AvailableKvMemory
    | AvailableMemory
    | KvCacheSize
    | MaxConcurrency
    | KvReserved
    | BlockCounts
    | PromptIgnored
)


@dataclass(frozen=True, slots=True)
class Origin:
    """Who wrote a line: the process id, and the rank when the line says so."""

    pid: int | None
    rank: int | None


@dataclass(frozen=True, slots=True)
class Located:
    """An event with where it was found."""

    event: LogEvent
    file: str
    line: int  # 1-based
    pid: int | None
    rank: int | None
    text: str


__all__ = [
    "AvailableKvMemory",
    "AvailableMemory",
    "BlockCounts",
    "DeviceMemoryInit",
    "KvCacheSize",
    "KvReserved",
    "LoadingStarted",
    "Located",
    "LogEvent",
    "MaxConcurrency",
    "MemoryStat",
    "MemoryStatKind",
    "ModelLoaded",
    "OomEvent",
    "OomKind",
    "Origin",
    "PromptIgnored",
]
