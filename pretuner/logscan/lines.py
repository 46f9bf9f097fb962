"""Pure per-line parser for the memory lines of MindSpore r0.1, vLLM V0 and the V1 engines (vLLM,
vllm-ascend, vLLM-MindSpore >= 0.3).

`parse_line` turns one log line (bytes or str, any garbage) into a typed event (`events`) or
None, and `parse_origin` reads the process that wrote it. Nothing here touches files: the
scanner finds candidate lines with `ANCHORS` and hands them over one by one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TypeVar

from pretuner.logscan.events import (
    AvailableKvMemory,
    AvailableMemory,
    BlockCounts,
    ChunkedPrefill,
    CompiledGraph,
    CpuKvSet,
    DeviceMemoryInit,
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
    KvReserved,
    LoadingStarted,
    Located,
    LogEvent,
    MaxConcurrency,
    MemoryStat,
    MemoryStatKind,
    ModelLoaded,
    OomEvent,
    OomKind,
    Origin,
    PromptIgnored,
    SchedulerDump,
    ServerReady,
    V1EngineConfig,
)
from pretuner.logscan.pooldump import HEADER_TEXT, SUMMARY_START, parse_pool_dump, parse_pool_header

_READY = ("Starting vLLM server on", "Application startup complete")
_START_FAILED = ("EngineCore failed to start", "Engine core initialization failed")
# Only this one: a stopped server also logs EngineDeadError while it shuts down.
_DEAD = "EngineCore encountered a fatal error"
_SCHEDULER_DUMP = "Dumping scheduler output"

# Literal texts of which every recognised line contains at least one. Each is at least 15
# bytes long: the scanner relies on that to find them through aligned 8-byte words.
ANCHORS: tuple[bytes, ...] = (
    b"actual peak used",  # every pool dump format, [MS_RUNTIME_PROF] and debug alloc details
    SUMMARY_START.encode(),  # a pool dump's summary line, even one cut before its peak
    HEADER_TEXT.encode(),  # the per-pool lines that open a best-fit pool dump
    b"Device MOC Size:",
    b"Device HBM Size:",
    b"Device MOC memory size: ",
    b"Device HBM memory size: ",
    b"MindSpore Used memory size: ",
    b"peak memory usage (with",  # both "(without fragments)" and "(with fragments)"
    b"isn't enough and alloc",
    b"Out of Memory!!!",
    b"Memory not enough:",
    b"max_device_memory should",
    b"out of memory. Tried to allocate",
    b"No available memory for the cache",
    b"stored in KV cache",
    b"estimated maximum model",
    b"Starting to load model",
    b"Model loading took",
    b"Loading model weights took",
    b"Available KV cache memory",
    b"Available memory: ",  # vllm-ascend <= 0.13, raw bytes
    b" KV cache size: ",
    b"Maximum concurrency for",
    b"reserved for KV Cache",
    b", # CPU blocks: ",
    b"is too long and exceeds",  # vLLM V0 ignored a prompt (block manager capacity or limit)
    b"you tried to allocate",  # vLLM on CPU: DefaultCPUAllocator
    # V1 engines: their KV cache, layout and arguments, readiness and death
    b"memory for KV Cache",
    b"`--kv-cache-memory=",  # the engine's own suggestion after profiling
    b"GiB for KV cache",
    b"Graph capturing finished",
    b"Capturing CUDA graphs",
    b"Estimated CUDA graph memory",
    b"Compiling a graph for",  # vLLM's torch.compile: compiled at start-up, or loaded
    b"Compiling model again",
    b"saved AOT compiled",
    b"Directly load the compiled",
    b"Directly load AOT compil",
    b"Chunked prefill is enabled",
    b"Encoder cache will be initialized",
    b"on startup is less than desired",
    b"'kv_cache_memory_bytes': ",
    b"'max_model_len': ",
    b"Using max model len",
    b"Initializing a V1 LLM engine",
    *(marker.encode() for marker in (*_READY, *_START_FAILED, _DEAD, _SCHEDULER_DUMP)),
)

MAX_PARSED_CHARS = 16384  # a longer "line" is garbage around a real hit: keep its head only
MAX_TEXT_BYTES = 32 * 2**10  # of a line kept as an event's text
MAX_FIGURE_DIGITS = 24  # a longer figure is garbage: its line is skipped


# `[INFO] PRE_ACT(pid,tid,python):` (C++) or `[INFO] ME(pid:tid,MainProcess):` (Python side)
_MS_PREFIX = re.compile(r"\[[A-Z]+\] [A-Z_]+\((\d+)[,:]")
# Where a writer's line starts: its MindSpore prefix, with the vLLM worker tag before it if any.
_LINE_START = re.compile(
    rb"(?:\([A-Za-z_]\w*[^()\n]{0,60}? pid=\d+\) )?\[[A-Z]+\] [A-Z_]+\(\d+[,:]"
)
# `(VllmWorker rank=0 pid=5361)`, `(EngineCore_DP0 pid=1102)`, `(VllmWorkerProcess pid=507)`
_VLLM_TAG = re.compile(r"\([A-Za-z_]\w*(?: rank=(\d+))?(?: TP(\d+))?[^()]{0,40}? pid=(\d+)\)")

_NUM = r"-?\d+(?:\.\d+)?"
_INIT_PAIR = re.compile(r"([A-Za-z][\w ()/.&,-]{0,80}?)\s?:\s?(\d+)([MG])\b")
_INIT_KEYS: tuple[tuple[str, str], ...] = (
    ("device free x size", "device_free"),
    ("user define mindspore x size", "user_define"),
    ("mindspore used x size", "mindspore_used"),
    ("device x size", "device"),
)
_RESERVED = re.compile(r"Reserved (?:MOC|HBM) size for Other Components[^:]{0,40}:(\d+)([MG])")

_STAT_KINDS = {
    "Device": MemoryStatKind.DEVICE,
    "MindSpore": MemoryStatKind.MINDSPORE_USED,
    "Used": MemoryStatKind.USED_PEAK,
    "Actual": MemoryStatKind.ACTUAL_PEAK,
}
_FREE_DEVICE = re.compile(r"Free Device Memory Size is (" + _NUM + r") ?GB")
_MAX_SEQ_LEN = re.compile(r"max seq len \((\d+)\)")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: (" + _NUM + r")x")
_CPU_NON_KV = re.compile(r"(" + _NUM + r") GiB memory was consumed by non-kv usages")
_ARG_KV_BYTES = re.compile(r"'kv_cache_memory_bytes': (\d+)")
_MAX_LEN = re.compile(r"(?:'max_model_len': |Using max model len )(\d+)")
_TP = re.compile(r"tensor_parallel_size=(\d+)")
_PP = re.compile(r"pipeline_parallel_size=(\d+)")
_KILLED = re.compile(r"Failed core proc\(s\): \{[^}]*: -(\d+)\}")  # -9: the OOM killer
_NEW_REQUESTS = "scheduled_new_reqs=[NewRequestData("  # the dumped step was a prefill

_UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"(" + _NUM + r") ?(GiB|MiB|KiB|B)"
_GRAPH_POOLS = re.compile(_SIZE + r" allocated in private pools")
_CAPACITY = re.compile(r"total capacity of (" + _NUM + r") ?GiB")
_CAPTURE_BAR = re.compile(r"Capturing CUDA graphs \(([^)]{1,40})\):[^|]*\|[^|]*\|\s*(\d+)/(\d+)")
T = TypeVar("T")


def _text(line: bytes | str) -> str:
    if isinstance(line, bytes):
        line = line[:MAX_PARSED_CHARS].decode("utf-8", errors="replace")
    else:
        line = line[:MAX_PARSED_CHARS]
    return line.rstrip("\r\n")


class GarbageFigure(ValueError):
    """A figure no log prints: hundreds of digits, or infinite once read."""


def _int(digits: str) -> int:
    digits = digits.replace(",", "")
    if len(digits) > MAX_FIGURE_DIGITS:  # int() refuses 4,300 digits; no memory figure has 20
        raise GarbageFigure(digits[:20])
    return int(digits)


def _float(digits: str) -> float:
    value = float(digits) if len(digits) <= MAX_FIGURE_DIGITS + 20 else math.inf
    if not math.isfinite(value):
        raise GarbageFigure(digits[:20])
    return value


def parse_origin(line: bytes | str) -> Origin:
    """The writer of a line: MindSpore's `(pid,tid,...)` prefix or vLLM's process tag."""
    head = _text(line[:512])
    try:
        if tag := _VLLM_TAG.search(head):
            rank = tag.group(1) or tag.group(2)
            return Origin(pid=_int(tag.group(3)), rank=_int(rank) if rank else None)
        if ms := _MS_PREFIX.search(head):
            return Origin(pid=_int(ms.group(1)), rank=None)
    except ValueError:  # a pid of hundreds of digits: no writer known
        pass
    return Origin(pid=None, rank=None)


def split_writers(raw: bytes) -> list[bytes]:
    """One piece per writer of a raw line.

    A process killed mid-line (its buffered log cut at a buffer boundary) leaves no newline,
    so the next process's line runs on in the same line: without the split, the first
    writer's cut pool dump would take the second writer's figures as its own.
    """
    starts = [m.start() for m in _LINE_START.finditer(raw)][1:]
    if not starts:
        return [raw]
    bounds = [0, *starts, len(raw)]
    return [raw[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def locate_line(raw: bytes, file: str, line: int, rank: int | None) -> list[Located]:
    """The events of one raw line (1-based `line`), each with its writer."""
    found: list[Located] = []
    for piece in split_writers(raw):
        event = parse_line(piece)
        if event is None:
            continue
        origin = parse_origin(piece)
        text = piece[:MAX_TEXT_BYTES].decode("utf-8", errors="replace").rstrip("\r\n")
        found.append(
            Located(event, file, line, origin.pid, rank if rank is not None else origin.rank, text)
        )
    return found


def parse_line(line: bytes | str) -> LogEvent | None:
    """The memory event a single log line carries, or None. Never raises on any input."""
    text = _text(line)
    try:
        for pattern, make in _PARSERS:  # the first found decides, even if its maker says None
            if (found := pattern.search(text)) is not None:
                return make(found)
    except (ValueError, OverflowError):  # GarbageFigure: hundreds of digits are no measurement
        return None
    return None


def _device_init(text: str) -> DeviceMemoryInit | None:
    if " Size:" not in text:
        return None
    kind = "MOC" if "Device MOC Size" in text else "HBM"
    figures: dict[str, int] = {}
    for match in _INIT_PAIR.finditer(text):
        key = match.group(1).strip().lower().replace(kind.lower(), "x")
        for suffix, name in _INIT_KEYS:
            if key.endswith(suffix) and name not in figures:
                figures[name] = _mib(match.group(2), match.group(3))
                break
    reserved = _RESERVED.search(text)
    if "device" not in figures:
        return None
    return DeviceMemoryInit(
        memory_kind=kind,
        device_mib=figures.get("device"),
        device_free_mib=figures.get("device_free"),
        reserved_other_mib=_mib(reserved.group(1), reserved.group(2)) if reserved else None,
        user_define_mib=figures.get("user_define"),
        mindspore_used_mib=figures.get("mindspore_used"),
    )


def _mib(digits: str, unit: str) -> int:
    return _int(digits) * (1024 if unit == "G" else 1)


def _max_device_memory(found: re.Match[str]) -> OomEvent:
    free = _FREE_DEVICE.search(found.string)
    return OomEvent(
        OomKind.MAX_DEVICE_MEMORY_RANGE,
        found.string[free.start() if free else found.start() : found.end()],
        free_device_gib=_float(free.group(1)) if free else None,
        max_device_memory_limit_mib=_float(found.group(1)),
        max_device_memory_requested_mib=_float(found.group(2)),
    )


def _estimated(found: re.Match[str]) -> OomEvent:
    seq = _MAX_SEQ_LEN.search(found.string)
    return OomEvent(
        OomKind.MAX_MODEL_LEN_TOO_LARGE,
        found.string[seq.start() if seq else found.start() : found.end()],
        max_model_len=_int(seq.group(1)) if seq else None,
        estimated_max_model_len=_int(found.group(1)),
    )


def _from(text: str, marker: str, otherwise: str) -> str:
    """The text from `marker` on, `otherwise` without it."""
    start = text.find(marker)
    return text[start:] if start >= 0 else otherwise


def _concurrency(text: str) -> MaxConcurrency | None:
    found = _CONCURRENCY.search(text)
    return MaxConcurrency(_int(found.group(1)), _float(found.group(2))) if found else None


def _bytes(figure: str, unit: str) -> int:
    return int(_float(figure) * _UNIT_BYTES[unit])


def _opt_size(found: re.Match[str] | None) -> int | None:
    return _bytes(found[1], found[2]) if found else None


def _capture_bar(text: str) -> GraphCapture:
    """The last state of a capture pass's progress bar (tqdm rewrites it on one line)."""
    *_, last = _CAPTURE_BAR.finditer(text)
    return GraphCapture(last[1], _int(last[2]), _int(last[3]))


def _opt(found: re.Match[str] | None, read: Callable[[str], T]) -> T | None:
    return read(found.group(1)) if found else None


_DEVICE_OOM = OomKind.DEVICE_OOM
# In order: an OOM report first (it may quote the pool statistics), then MindSpore's pool and
# device lines, vLLM's (V0 and V1) KV figures, and the V1 engines' layout, arguments and fate.
_TABLE: tuple[tuple[str, Callable[[re.Match[str]], LogEvent | None]], ...] = (
    (r"[Mm]emory isn't enough and alloc failed(?: in output actor)?, kernel name: ?(.{0,400}?),"
     r" alloc size: ?(\d+)B",
     lambda m: OomEvent(_DEVICE_OOM, m[0], alloc_bytes=_int(m[2]), kernel=m[1].strip() or None)),
    (r"Out of Memory!!! Request memory size: ?(\d+)B",
     lambda m: OomEvent(_DEVICE_OOM, m[0], alloc_bytes=_int(m[1]))),
    (r"Memory not enough: (?:current free memory size|alloc size)\[(\d+)\]"
     r" is smaller than required size\[(\d+)\]",
     lambda m: OomEvent(_DEVICE_OOM, m[0], alloc_bytes=_int(m[2]))),
    (r"(?:NPU|CUDA|XPU|HPU) out of memory\. Tried to allocate " + _SIZE,
     lambda m: OomEvent(_DEVICE_OOM, m[0], alloc_bytes=_bytes(m[1], m[2]),
                        graph_pool_bytes=_opt_size(_GRAPH_POOLS.search(m.string)),
                        capacity_gib=_opt(_CAPACITY.search(m.string), _float))),
    (r"you tried to allocate (\d+) bytes",  # vLLM on CPU: DefaultCPUAllocator
     lambda m: OomEvent(_DEVICE_OOM, _from(m.string, "DefaultCPUAllocator", m[0]),
                        alloc_bytes=_int(m[1]))),
    (r"max_device_memory should be in range \(0-(" + _NUM + r")\]MB, but got (" + _NUM + r")MB",
     _max_device_memory),
    (r"No available memory for the cache blocks",
     lambda m: OomEvent(OomKind.KV_BLOCKS_EXHAUSTED,
                        _from(m.string, "No available memory", "").strip())),
    (r"max seq len \((\d+)\) is larger than the maximum number of tokens that can be stored"
     r" in KV cache \((\d+)\)",
     lambda m: OomEvent(OomKind.MAX_MODEL_LEN_TOO_LARGE, m[0], max_model_len=_int(m[1]),
                        kv_cache_tokens=_int(m[2]))),
    (r"estimated maximum model length is (\d+)", _estimated),
    (f"actual peak used|{SUMMARY_START}", lambda m: parse_pool_dump(m.string)),
    (HEADER_TEXT, lambda m: parse_pool_header(m.string)),
    (r"Device (?:MOC|HBM) Size", lambda m: _device_init(m.string)),
    (r"(Device (?:MOC|HBM) memory size|MindSpore Used memory size"
     r"|Used peak memory usage \(without fragments\)|Actual peak memory usage \(with fragments\))"
     r"\s?:\s?(\d+)M", lambda m: MemoryStat(_STAT_KINDS[m[1].split(" ", 1)[0]], _int(m[2]))),
    # vLLM (V0 and V1), vllm-ascend ("GB" are GiB)
    (r"Starting to load model", lambda m: LoadingStarted()),
    (r"Model loading took (" + _NUM + r") ?(GiB|GB)(?: memory)?(?: and (" + _NUM + r") ?s)?",
     lambda m: ModelLoaded(_float(m[1]), _float(m[3]) if m[3] else None)),
    (r"Loading model weights took (" + _NUM + r") ?(GiB|GB)",
     lambda m: ModelLoaded(_float(m[1]), None)),
    (r"Available KV cache memory: (" + _NUM + r") ?GiB",
     lambda m: AvailableKvMemory(_float(m[1]))),
    (r"Available memory: (-?\d+), total memory: (\d+)",  # vllm-ascend <= 0.13
     lambda m: AvailableMemory(max(0, _int(m[1])), _int(m[2]))),
    (r" KV cache size: ([\d,]+) tokens",
     lambda m: KvCacheSize(_int(m[1]), _concurrency(m.string))),
    (_CONCURRENCY.pattern, lambda m: _concurrency(m.string)),
    (r"reserved for KV Cache is (" + _NUM + r") ?GiB", lambda m: KvReserved(_float(m[1]))),
    (r"# (?:GPU|NPU|npu|gpu) blocks: (\d+), # CPU blocks: (\d+)",
     lambda m: BlockCounts(_int(m[1]), _int(m[2]))),
    (r"Input prompt \((\d+) tokens\) is too long and exceeds (?:the capacity of block_manager"
     r"|limit of (\d+))", lambda m: PromptIgnored(_int(m[1]), _int(m[2]) if m[2] else None)),
    # V1 engines beyond their KV cache size: pinned or CPU KV, layout, arguments, readiness, death
    (r"Initial free memory (" + _NUM + r") ?GiB, reserved (" + _NUM + r") ?GiB memory for KV Cache",
     lambda m: KvPinned(_float(m[1]), _float(m[2]))),
    (r"`--kv-cache-memory=(-?\d+)`.*?to fit into requested memory, or `--kv-cache-memory="
     r"(-?\d+)`", lambda m: KvAdvice(_int(m[1]), _int(m[2]))),
    (r"(Auto|Explicitly) set \((" + _NUM + r")/(" + _NUM + r")\) GiB for KV cache",
     lambda m: CpuKvSet(m[1] == "Explicitly", _float(m[2]), _float(m[3]),
                        _opt(_CPU_NON_KV.search(m.string), _float))),
    (r"Graph capturing finished in \d+ secs?, took (" + _NUM + r") ?GiB",
     lambda m: GraphsCaptured(_float(m[1]))),
    (_CAPTURE_BAR.pattern, lambda m: _capture_bar(m.string)),
    (r"Estimated CUDA graph memory: (" + _NUM + r") ?GiB", lambda m: GraphsEstimated(_float(m[1]))),
    (r"Compiling a graph for compile range|Compiling model again due to a load failure"
     r"|saved AOT compiled function|Directly load (?:the compiled graph|AOT compilation)",
     lambda m: CompiledGraph("warm" if m[0].startswith("Directly") else "cold")),
    (r"Chunked prefill is enabled.*?max_num_batched_tokens=(\d+)",
     lambda m: ChunkedPrefill(_int(m[1]))),
    (r"Encoder cache will be initialized with a budget of (\d+) tokens, and "
     r"profiled with (\d+) \w+ items", lambda m: EncoderBudget(_int(m[1]), _int(m[2]))),
    (r"\((" + _NUM + r")/(" + _NUM + r") GiB\) on startup is less than desired (?:GPU|CPU) "
     r"memory utilization \((" + _NUM + r"), (" + _NUM + r") GiB\)",
     lambda m: DeviceRefused(*(_float(m[i]) for i in range(1, 5)))),
    (r"Initializing a V1 LLM engine",
     lambda m: V1EngineConfig(_opt(_TP.search(m.string), _int), _opt(_PP.search(m.string), _int))),
    (f"{_ARG_KV_BYTES.pattern}|{_MAX_LEN.pattern}",
     lambda m: EngineArgs(_opt(_ARG_KV_BYTES.search(m.string), _int),
                          _opt(_MAX_LEN.search(m.string), _int))),
    ("|".join(_START_FAILED),
     lambda m: EngineStartFailed(_opt(_KILLED.search(m.string), _int))),
    (_DEAD, lambda m: EngineDied()),
    (_SCHEDULER_DUMP, lambda m: SchedulerDump(_NEW_REQUESTS in m.string)),
    ("|".join(_READY), lambda m: ServerReady()),
)
_PARSERS = tuple((re.compile(pattern), make) for pattern, make in _TABLE)
