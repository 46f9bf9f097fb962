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
        match e:
            case PoolDump() | PartialPoolDump() | PoolDumpHeader():
                return self if self.pool_dump else replace(self, pool_dump=True)
            case ModelLoaded():
                return replace(self, weights_gib=_or(self.weights_gib, e.weights_gib))
            case AvailableKvMemory():
                return replace(self, available_kv_gib=_or(self.available_kv_gib, e.gib))
            case KvPinned():
                free = _or(self.initial_free_gib, e.initial_free_gib)
                return replace(self, initial_free_gib=free,
                               pinned_kv_gib=_or(self.pinned_kv_gib, e.kv_gib))
            case CpuKvSet():
                log = replace(self, non_kv_gib=_or(self.non_kv_gib, e.non_kv_gib))
                if e.pinned:
                    return replace(log, pinned_kv_gib=_or(self.pinned_kv_gib, e.kv_gib))
                return replace(log, available_kv_gib=_or(self.available_kv_gib, e.kv_gib))
            case KvAdvice():
                return replace(self, advice=_or(self.advice, e))
            case KvCacheSize():
                tokens = e.tokens if self.kv_tokens is None else min(self.kv_tokens, e.tokens)
                log = replace(self, kv_tokens=tokens)
                return log if e.concurrency is None else log.add(e.concurrency)
            case MaxConcurrency():
                return replace(self, max_concurrency=_or(self.max_concurrency, e.concurrency),
                               max_model_len=_or(self.max_model_len, e.tokens_per_request))
            case GraphsCaptured():
                return replace(self, graphs_gib=_or(self.graphs_gib, e.gib))
            case GraphsEstimated():
                return replace(self, graphs_estimated_gib=_or(self.graphs_estimated_gib, e.gib))
            case GraphCapture():
                passes = tuple(p for p in self.graph_capture if p[0] != e.mode)
                return replace(self, graph_capture=(*passes, (e.mode, e.done, e.total)))
            case ChunkedPrefill():
                return replace(self, max_num_batched_tokens=_or(self.max_num_batched_tokens,
                                                                e.max_num_batched_tokens))
            case EncoderBudget():
                return replace(
                    self, encoder_budget_tokens=_or(self.encoder_budget_tokens, e.budget_tokens),
                    encoder_profiled_items=_or(self.encoder_profiled_items, e.profiled_items))
            case DeviceRefused():
                return replace(self, refused_free_gib=_or(self.refused_free_gib, e.free_gib))
            case EngineArgs():
                return replace(self, pinned_kv_bytes=_or(self.pinned_kv_bytes,
                                                         e.kv_cache_memory_bytes),
                               max_model_len=_or(self.max_model_len, e.max_model_len))
            case V1EngineConfig():
                return replace(self, tp=_or(self.tp, e.tp), pp=_or(self.pp, e.pp), v1_engine=True)
            case ServerReady():
                return replace(self, ready=True)
            case EngineStartFailed():
                return replace(self, start_failed=True,
                               killed_by_signal=_or(self.killed_by_signal, e.killed_by_signal))
            case EngineDied():
                return replace(self, engine_dead=True)
            case SchedulerDump():
                return replace(self, prefill_died=self.prefill_died or e.prefill)
            case OomEvent():
                return self._oom(e)
        return self

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
