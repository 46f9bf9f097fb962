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
    graph_pool_bytes: int | None = None  # torch's "allocated in private pools (e.g., CUDA Graphs)"
    capacity_gib: float | None = None  # torch's "total capacity" of the device


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
class MaxConcurrency:
    """`Maximum concurrency for 4,096 tokens per request: 265.25x`."""

    tokens_per_request: int
    concurrency: float


@dataclass(frozen=True, slots=True)
class KvCacheSize:
    """`GPU KV cache size: 645,120 tokens` (vLLM on CPU goes on `, Maximum concurrency ...`)."""

    tokens: int
    concurrency: MaxConcurrency | None = None


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
    """vLLM V0's scheduler dropped a prompt: it never ran, and its reply is empty."""

    prompt_tokens: int
    # None: it `exceeds the capacity of block_manager` (the KV cache cannot hold it beside the
    # 1 % block watermark), else the prompt limit it exceeded
    limit: int | None

# -- V1 engines (vLLM >= 0.8, vllm-ascend, vLLM-MindSpore >= 0.3): their start-up and death --


@dataclass(frozen=True, slots=True)
class KvPinned:
    """`Initial free memory 78.66 GiB, reserved 59.0 GiB memory for KV Cache` (pinned bytes)."""

    initial_free_gib: float
    kv_gib: float


@dataclass(frozen=True, slots=True)
class KvAdvice:
    """The engine's own suggestion after profiling (vLLM's INFO line since PR 47374, DEBUG
    before): "`--kv-cache-memory=N` ... to fit into requested memory, or
    `--kv-cache-memory=M` ... to fully utilize gpu memory" (bytes; either may be negative)."""

    requested_bytes: int
    full_bytes: int


@dataclass(frozen=True, slots=True)
class CpuKvSet:
    """vLLM on CPU: `Explicitly set (1.0/11.96) GiB for KV cache` (pinned) or `Auto set ...`."""

    pinned: bool
    kv_gib: float
    node_gib: float
    non_kv_gib: float | None


@dataclass(frozen=True, slots=True)
class GraphsCaptured:
    """`Graph capturing finished in 8 secs, took 1.01 GiB`: after the KV cache was allocated."""

    gib: float


@dataclass(frozen=True, slots=True)
class CompiledGraph:
    """vLLM's torch.compile at start-up: "cold" where the cache had no entry for this
    configuration (`Compiling a graph for compile range (1, 8192) takes 14.54 s`; on CPU, vLLM
    0.32's `Compiling model again due to a load failure` or `saved AOT compiled function`),
    "warm" where it loaded one (`Directly load the compiled graph(s) ...`, `Directly load AOT
    compilation from path ...`)."""

    state: str


@dataclass(frozen=True, slots=True)
class GraphCapture:
    """`Capturing CUDA graphs (FULL): ... 1/51`: how far one capture pass got (its last bar)."""

    mode: str
    done: int
    total: int


@dataclass(frozen=True, slots=True)
class GraphsEstimated:
    """`Estimated CUDA graph memory: 0.61 GiB total` (vLLM >= 0.21 profiles graph capture)."""

    gib: float


@dataclass(frozen=True, slots=True)
class ChunkedPrefill:
    """`Chunked prefill is enabled with max_num_batched_tokens=8192.`"""

    max_num_batched_tokens: int


@dataclass(frozen=True, slots=True)
class EncoderBudget:
    """`Encoder cache will be initialized with a budget of 2048 tokens, and profiled with 2 ...`"""

    budget_tokens: int
    profiled_items: int


@dataclass(frozen=True, slots=True)
class DeviceRefused:
    """`... (40.1/79.18 GiB) on startup is less than desired GPU memory utilization (0.9, ...)`"""

    free_gib: float
    total_gib: float
    util: float
    desired_gib: float


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """`non-default args: {'max_model_len': 32768, 'kv_cache_memory_bytes': 63350767616}` (the
    pinned bytes exactly), or `Using max model len 32768`."""

    kv_cache_memory_bytes: int | None
    max_model_len: int | None


@dataclass(frozen=True, slots=True)
class V1EngineConfig:
    """`Initializing a V1 LLM engine (v0.24.0) with config: ... tensor_parallel_size=1, ...`"""

    tp: int | None
    pp: int | None


@dataclass(frozen=True, slots=True)
class ServerReady:
    """`Starting vLLM server on http://...` or uvicorn's `Application startup complete.`"""


@dataclass(frozen=True, slots=True)
class EngineStartFailed:
    """`EngineCore failed to start.`, `... Failed core proc(s): {'EngineCore_DP0': -9}`."""

    killed_by_signal: int | None


@dataclass(frozen=True, slots=True)
class EngineDied:
    """`EngineCore encountered a fatal error` (a stopped server logs only EngineDeadError)."""


@dataclass(frozen=True, slots=True)
class SchedulerDump:
    """`Dumping scheduler output` of the step that killed the engine (`prefill`: new requests)."""

    prefill: bool


LogEvent = (
    PoolDump | PartialPoolDump | PoolDumpHeader | DeviceMemoryInit | MemoryStat | OomEvent
    | LoadingStarted | ModelLoaded | AvailableKvMemory | AvailableMemory | KvCacheSize
    | MaxConcurrency | KvReserved | BlockCounts | PromptIgnored | KvPinned | KvAdvice | CpuKvSet
    | GraphsCaptured | GraphCapture | GraphsEstimated | CompiledGraph | ChunkedPrefill
    | EncoderBudget
    | DeviceRefused | EngineArgs
    | V1EngineConfig | ServerReady | EngineStartFailed | EngineDied | SchedulerDump
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

