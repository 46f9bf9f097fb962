"""What a V1 engine's log says (vLLM >= 0.8 on CUDA and CPU, vllm-ascend, vLLM-MindSpore >= 0.3
share vLLM's V1 worker and its lines): its events folded in log order by the scan's summary.

Of each figure it keeps the first (a multi-rank log repeats them; the ranks of one engine
agree) except the KV token count, where the smallest rank decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

from pretuner.logscan.events import (
    AvailableKvMemory,
    ChunkedPrefill,
    CompiledGraph,
    CpuKvSet,
    DeviceRefused,
    EncoderBudget,
    EngineArgs,
    EngineDied,
    EngineStartFailed,
    GraphCapture,
    GraphsCaptured,
    GraphsEstimated,
    KvAdvice,
    KvCacheSize,
    KvPinned,
    LogEvent,
    MaxConcurrency,
    ModelLoaded,
    OomEvent,
    OomKind,
    SchedulerDump,
    ServerReady,
    V1EngineConfig,
)
from pretuner.logscan.pooldump import PartialPoolDump, PoolDump, PoolDumpHeader

T = TypeVar("T")


def _or(first: T | None, then: T | None) -> T | None:
    return first if first is not None else then


# Of each event, the fields it fills (the first figure stays: `_or`) and the flag it sets.
_FILLS: dict[type, tuple[tuple[str, str], ...]] = {
    ModelLoaded: (("weights_gib", "weights_gib"),),
    AvailableKvMemory: (("available_kv_gib", "gib"),),
    KvPinned: (("initial_free_gib", "initial_free_gib"), ("pinned_kv_gib", "kv_gib")),
    MaxConcurrency: (("max_concurrency", "concurrency"), ("max_model_len", "tokens_per_request")),
    GraphsCaptured: (("graphs_gib", "gib"),),
    GraphsEstimated: (("graphs_estimated_gib", "gib"),),
    CompiledGraph: (("compile_cache", "state"),),
    ChunkedPrefill: (("max_num_batched_tokens", "max_num_batched_tokens"),),
    EncoderBudget: (("encoder_budget_tokens", "budget_tokens"),
                    ("encoder_profiled_items", "profiled_items")),
    DeviceRefused: (("refused_free_gib", "free_gib"),),
    EngineArgs: (("pinned_kv_bytes", "kv_cache_memory_bytes"), ("max_model_len", "max_model_len")),
    V1EngineConfig: (("tp", "tp"), ("pp", "pp")),
    EngineStartFailed: (("killed_by_signal", "killed_by_signal"),),
}
_SETS: dict[type, str] = {
    PoolDump: "pool_dump", PartialPoolDump: "pool_dump", PoolDumpHeader: "pool_dump",
    V1EngineConfig: "v1_engine", ServerReady: "ready", EngineStartFailed: "start_failed",
    EngineDied: "engine_dead",
}


@dataclass(frozen=True, slots=True)
class V1Log:
    """The memory facts of one V1 server log (GiB as the engine prints them, 1024-based)."""

    weights_gib: float | None = None
    available_kv_gib: float | None = None  # what profiling left for the KV cache
    pinned_kv_gib: float | None = None  # --kv-cache-memory-bytes, as the engine took it
    initial_free_gib: float | None = None  # free device memory when the engine started
    non_kv_gib: float | None = None  # vLLM on CPU says what profiling found outside the KV
    kv_tokens: int | None = None
    max_concurrency: float | None = None
    graphs_gib: float | None = None  # CUDA graph capture, after the KV cache was allocated
    graphs_estimated_gib: float | None = None  # the engine's estimate of that capture
    graph_capture: tuple[tuple[str, int, int], ...] = ()  # (mode, done, of) per capture pass
    compile_cache: str | None = None  # "cold": torch.compile compiled at start-up; "warm": loaded
    graph_pool_bytes: int | None = None  # in CUDA graph pools when the first OOM struck
    capacity_gib: float | None = None  # the device's total, as the first OOM said it
    max_num_batched_tokens: int | None = None
    encoder_budget_tokens: int | None = None  # a vision-language model's encoder cache
    encoder_profiled_items: int | None = None  # dummy items of the largest size it profiled
    oom_alloc_bytes: int | None = None  # the allocation that failed first
    oom_text: str | None = None
    estimated_max_len: int | None = None  # vLLM: one max_model_len sequence does not fit
    no_kv_memory: bool = False  # "No available memory for the cache blocks"
    refused_free_gib: float | None = None  # util asked more than this free memory at start
    start_failed: bool = False
    engine_dead: bool = False  # the engine died while serving (HTTP 500 from then on)
    ready: bool = False
    killed_by_signal: int | None = None  # an engine process died of this signal at start-up
    pinned_kv_bytes: int | None = None  # --kv-cache-memory-bytes exactly, as the API echoed it
    max_model_len: int | None = None
    tp: int | None = None
    pp: int | None = None
    v1_engine: bool = False  # "Initializing a V1 LLM engine"
    pool_dump: bool = False  # a MindSpore pool dump: the r0.1 method's log
    prefill_died: bool = False  # the step that killed the engine scheduled new requests
    advice: KvAdvice | None = None  # the engine's own suggested KV bytes (shown, never adopted)

    @property
    def kv_gib(self) -> float | None:
        """The KV cache the engine allocated: pinned, else what profiling gave it."""
        return self.pinned_kv_gib if self.pinned_kv_gib is not None else self.available_kv_gib

    @property
    def kv_sized(self) -> bool:
        """The engine sized its KV cache, so the weights were in: vLLM on CPU prints no weights
        figure, but its "Explicitly/Auto set ... GiB for KV cache" comes after the model loaded."""
        return self.kv_gib is not None or self.kv_tokens is not None

    @property
    def weights_loaded(self) -> bool:
        return self.weights_gib is not None or self.kv_sized

    @property
    def failed_oom(self) -> bool:
        return self.oom_alloc_bytes is not None or self.oom_text is not None

    @property
    def is_v1(self) -> bool:
        """Whether this is a V1 engine's log (a MindSpore pool dump makes it r0.1's)."""
        return (self.v1_engine or self.kv_sized) and not self.pool_dump

    def add(self, e: LogEvent) -> V1Log:
        """This log with one more event, in log order."""
        changes = {name: getattr(e, attr) for name, attr in _FILLS.get(type(e), ())
                   if getattr(self, name) is None}
        if (flag := _SETS.get(type(e))) is not None and not getattr(self, flag):
            changes[flag] = True
        match e:
            case KvAdvice():
                changes["advice"] = _or(self.advice, e)
            case CpuKvSet():
                changes["non_kv_gib"] = _or(self.non_kv_gib, e.non_kv_gib)
                kv = "pinned_kv_gib" if e.pinned else "available_kv_gib"
                changes[kv] = _or(getattr(self, kv), e.kv_gib)
            case KvCacheSize():
                tokens = e.tokens if self.kv_tokens is None else min(self.kv_tokens, e.tokens)
                log = replace(self, kv_tokens=tokens)
                return log if e.concurrency is None else log.add(e.concurrency)
            case GraphCapture():
                passes = tuple(p for p in self.graph_capture if p[0] != e.mode)
                changes["graph_capture"] = (*passes, (e.mode, e.done, e.total))
            case SchedulerDump():
                changes["prefill_died"] = self.prefill_died or e.prefill
            case OomEvent():
                return self._oom(e)
        return replace(self, **changes) if changes else self

    def _oom(self, e: OomEvent) -> V1Log:
        if e.kind is OomKind.MAX_DEVICE_MEMORY_RANGE:  # r0.1's max_device_memory: not V1's
            return self
        text = _or(self.oom_text, e.message)
        if e.kind is OomKind.KV_BLOCKS_EXHAUSTED:
            return replace(self, no_kv_memory=True, oom_text=text)
        if e.kind is OomKind.MAX_MODEL_LEN_TOO_LARGE:
            return replace(self, oom_text=text, estimated_max_len=_or(
                self.estimated_max_len, e.estimated_max_model_len))
        return replace(self, oom_text=text,
                       oom_alloc_bytes=_or(self.oom_alloc_bytes, e.alloc_bytes),
                       graph_pool_bytes=_or(self.graph_pool_bytes, e.graph_pool_bytes),
                       capacity_gib=_or(self.capacity_gib, e.capacity_gib))
