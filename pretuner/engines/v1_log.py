"""What a V1 engine's log says about memory: one pure reader for vLLM >= 0.8 on CUDA and CPU,
vllm-ascend and vLLM-MindSpore >= 0.3 (they share vLLM's V1 worker and its lines).

`read_v1_log(lines)` never raises: a line it does not know is skipped. It keeps the first
figure of each kind (a multi-rank log repeats them; the ranks of one engine agree) except the
KV token count, where the smallest rank decides. OOM texts are the ones `pretuner.logscan`
already knows (torch's `Tried to allocate`, CPU `you tried to allocate N bytes`, vLLM's
"estimated maximum model length"), read through its parser so both agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from pretuner.logscan.events import OomEvent, OomKind
from pretuner.logscan.lines import parse_line

_NUM = r"-?\d+(?:\.\d+)?"
_WEIGHTS = re.compile(r"(?:Model loading took|Loading model weights took) (" + _NUM + r") ?Gi?B")
_AVAILABLE = re.compile(r"Available KV cache memory: (" + _NUM + r") ?GiB")
_PINNED = re.compile(
    r"Initial free memory (" + _NUM + r") ?GiB, reserved (" + _NUM + r") ?GiB memory for KV Cache"
)
# vLLM on CPU: "Auto set (2.7/11.34) GiB for KV cache on node 0, ... 0.7 GiB memory was consumed
# by non-kv usages." / "Explicitly set (1.0/11.96) GiB for KV cache on node 0."
_CPU_SET = re.compile(r"(Auto|Explicitly) set \((" + _NUM + r")/(" + _NUM + r")\) GiB for KV cache")
_CPU_NON_KV = re.compile(r"(" + _NUM + r") GiB memory was consumed by non-kv usages")
_KV_TOKENS = re.compile(r"(?:GPU|CPU|NPU) KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: (" + _NUM + r")x")
_GRAPHS = re.compile(r"Graph capturing finished in \d+ secs?, took (" + _NUM + r") ?GiB")
_BATCHED = re.compile(r"max_num_batched_tokens=(\d+)")
_CPU_ALLOC = re.compile(r"you tried to allocate (\d+) bytes")
_ENCODER = re.compile(r"Encoder cache will be initialized with a budget of (\d+) tokens, and "
                      r"profiled with (\d+) \w+ items")
# An engine process ended by a signal while starting (-9: the kernel's OOM killer, the host).
_KILLED = re.compile(r"Failed core proc\(s\): \{[^}]*: -(\d+)\}")
_REFUSED = re.compile(
    r"\((" + _NUM + r")/(" + _NUM + r") GiB\) on startup is less than desired (?:GPU|CPU) memory "
    r"utilization \((" + _NUM + r"), (" + _NUM + r") GiB\)"
)
_START_FAILED = ("EngineCore failed to start", "Engine core initialization failed")
# Only this one: a stopped server also logs EngineDeadError while it shuts down.
_DEAD = ("EngineCore encountered a fatal error",)
_READY = ("Starting vLLM server on", "Application startup complete")


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
    # The engine sized its KV cache, so the weights were in: vLLM on CPU prints no weights
    # figure, but its "Explicitly/Auto set ... GiB for KV cache" comes after the model loaded.
    kv_sized: bool = False
    killed_by_signal: int | None = None  # an engine process died of this signal at start-up

    @property
    def kv_gib(self) -> float | None:
        """The KV cache the engine allocated: pinned, else what profiling gave it."""
        return self.pinned_kv_gib if self.pinned_kv_gib is not None else self.available_kv_gib

    @property
    def weights_loaded(self) -> bool:
        return self.weights_gib is not None or self.kv_sized

    @property
    def failed_oom(self) -> bool:
        return self.oom_alloc_bytes is not None or self.oom_text is not None


def _num(text: str) -> float:
    return float(text)


def read_v1_log(lines: Iterable[str]) -> V1Log:
    """Every memory fact of a V1 log, from its lines."""
    found: dict[str, object] = {}
    for raw in lines:
        line = raw.rstrip("\r\n")
        _read_line(line, found)
    return V1Log(**found)  # type: ignore[arg-type]


def _first(found: dict[str, object], key: str, value: object) -> None:
    if key not in found:
        found[key] = value


def _read_line(line: str, found: dict[str, object]) -> None:
    if any(marker in line for marker in _READY):
        found["ready"] = True
    if any(marker in line for marker in _START_FAILED):
        found["start_failed"] = True
    if any(marker in line for marker in _DEAD):
        found["engine_dead"] = True
    for pattern, key in ((_WEIGHTS, "weights_gib"), (_AVAILABLE, "available_kv_gib"),
                         (_GRAPHS, "graphs_gib"), (_CPU_NON_KV, "non_kv_gib")):
        if (m := pattern.search(line)) is not None:
            _first(found, key, _num(m.group(1)))
    if (m := _PINNED.search(line)) is not None:
        _first(found, "initial_free_gib", _num(m.group(1)))
        _first(found, "pinned_kv_gib", _num(m.group(2)))
    if (m := _CPU_SET.search(line)) is not None:
        key = "pinned_kv_gib" if m.group(1) == "Explicitly" else "available_kv_gib"
        _first(found, key, _num(m.group(2)))
    if any(p.search(line) for p in (_AVAILABLE, _PINNED, _CPU_SET, _KV_TOKENS)):
        found["kv_sized"] = True
    if (m := _KV_TOKENS.search(line)) is not None:
        tokens = int(m.group(1).replace(",", ""))
        found["kv_tokens"] = min(tokens, int(found.get("kv_tokens", tokens)))  # type: ignore[call-overload]
    if (m := _CONCURRENCY.search(line)) is not None:
        _first(found, "max_concurrency", _num(m.group(2)))
    if (m := _BATCHED.search(line)) is not None and "Chunked prefill" in line:
        _first(found, "max_num_batched_tokens", int(m.group(1)))
    if (m := _REFUSED.search(line)) is not None:
        _first(found, "refused_free_gib", _num(m.group(1)))
    if (m := _ENCODER.search(line)) is not None:
        _first(found, "encoder_budget_tokens", int(m.group(1)))
        _first(found, "encoder_profiled_items", int(m.group(2)))
    if (m := _KILLED.search(line)) is not None:
        _first(found, "killed_by_signal", int(m.group(1)))
    _read_oom(line, found)


def _read_oom(line: str, found: dict[str, object]) -> None:
    if (m := _CPU_ALLOC.search(line)) is not None:
        _first(found, "oom_alloc_bytes", int(m.group(1)))
        _first(found, "oom_text", line[line.find("DefaultCPUAllocator"):] or line)
        return
    if "Tried to allocate" not in line and "cache blocks" not in line \
            and "maximum model length" not in line and "stored in KV cache" not in line:
        return
    event = parse_line(line)
    if not isinstance(event, OomEvent):
        return
    if event.kind is OomKind.DEVICE_OOM:
        if event.alloc_bytes is not None:
            _first(found, "oom_alloc_bytes", event.alloc_bytes)
        _first(found, "oom_text", event.message)
    elif event.kind is OomKind.KV_BLOCKS_EXHAUSTED:
        found["no_kv_memory"] = True
        _first(found, "oom_text", event.message)
    elif event.kind is OomKind.MAX_MODEL_LEN_TOO_LARGE:
        if event.estimated_max_model_len is not None:
            _first(found, "estimated_max_len", event.estimated_max_model_len)
        _first(found, "oom_text", event.message)
