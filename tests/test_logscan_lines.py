"""Case tables for the per-line parser: every line kind, verbatim texts."""

from __future__ import annotations

import pytest

from pretuner.logscan.events import (
    AvailableKvMemory,
    AvailableMemory,
    BlockCounts,
    ChunkedPrefill,
    CpuKvSet,
    DeviceMemoryInit,
    DeviceRefused,
    EncoderBudget,
    EngineArgs,
    EngineDied,
    EngineStartFailed,
    GraphsCaptured,
    KvCacheSize,
    KvPinned,
    KvReserved,
    LoadingStarted,
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
from pretuner.logscan.lines import ANCHORS, parse_line, parse_origin
from pretuner.logscan.pooldump import PoolDump, PoolFormat

PREFIX = (
    "[INFO] PRE_ACT(1234,7f44c3888b80,python):2025-05-16-23:06:54.123.456 "
    "[mindspore/ccsrc/runtime/memory/mem_pool/mem_dynamic_allocator.cc:1211] "
    "DumpDynamicMemPoolStateInfo] "
)
STAT = (
    '{"in used mem":28688.13MB,"peak used mem":29331.56MB,"alloc mem":29696.00MB,'
    '"idle mem":1007.86MB,"used by event mem":0.00MB,"eager free mem":0.00MB}'
)
SIZES = (
    "Weight used size:0M, constant value used size:0M, kernel output used size:0M, "
    "other used size:28688M."
)

POOL_CASES = [
    pytest.param(
        f"The dynamic memory pool stat info : {STAT}, actual peak used mem:29614M. {SIZES}",
        PoolFormat.STAT_JSON,
        None,
        29614,
        {"peak_used_mib": 29331.56, "in_use_mib": 28688.13, "alloc_mib": 29696.0},
        id="ms24-json",
    ),
    pytest.param(
        f"The dynamic memory pool[DefaultAscendMemoryPool] stat info : {STAT}, "
        f"actual peak used mem:29614M. {SIZES}",
        PoolFormat.NAMED_POOL,
        "DefaultAscendMemoryPool",
        29614,
        {"idle_mib": 1007.86, "other_mib": 28688.0},
        id="ms26-named",
    ),
    pytest.param(
        f"The dynamic memory pool[DefaultEnhancedAscendMemoryPool] stat info : {STAT}, "
        f'actual peak used mem:31000M. {SIZES}, detail : {{"peak used mem":1.00MB}}',
        PoolFormat.NAMED_POOL,
        "DefaultEnhancedAscendMemoryPool",
        31000,
        {"peak_used_mib": 29331.56},
        id="ms26-enhanced-detail",
    ),
    pytest.param(
        "The dynamic memory pool total allocated mem:5120M, min addr :0, max addr: 0, "
        "peak used mem:3125M, actual peak used mem:4634M, in used mem:390M, total used by "
        "event mem:0M, total idle mem:4729M, total eager free mem:0M. Weight used size:0M, "
        "constant value used size:0M, kernel output used size:0M, other used size:390M.",
        PoolFormat.BEST_FIT,
        None,
        4634,
        {"peak_used_mib": 3125.0, "in_use_mib": 390.0, "alloc_mib": 5120.0, "idle_mib": 4729.0},
        id="best-fit",
    ),
    pytest.param(
        "Alloc memory details, name:Default/MatMul-op0, address:0x7f00, size:1048576B, "
        "total allocated mem:1073741824B, peak used mem:2097152B, in used mem:1048576B, "
        "used by event mem:0B, actual peak used mem:3145729B, total idle mem:0B",
        PoolFormat.ALLOC_DETAIL,
        None,
        4,  # 3 MiB and one byte, rounded up
        {"peak_used_mib": 2.0},
        id="debug-alloc-detail-bytes",
    ),
]


@pytest.mark.parametrize(("text", "fmt", "pool", "actual", "fields"), POOL_CASES)
def test_pool_dumps(
    text: str, fmt: PoolFormat, pool: str | None, actual: int, fields: dict[str, float]
) -> None:
    event = parse_line(PREFIX + text)
    assert isinstance(event, PoolDump)
    assert event.format is fmt
    assert event.pool_name == pool
    assert event.actual_peak_mib == actual
    for name, value in fields.items():
        assert getattr(event, name) == pytest.approx(value)
    assert not event.profiled


def test_runtime_prof_dump_is_marked() -> None:
    line = (
        "[MS_RUNTIME_PROF]The dynamic memory pool total allocated mem:1024M, min addr :0, "
        "max addr: 0, peak used mem:32M, actual peak used mem:32M, in used mem:4M, total used "
        "by event mem:0M, total idle mem:1019M, total eager free mem:0M."
    )
    event = parse_line(line)
    assert isinstance(event, PoolDump)
    assert event.profiled
    assert event.actual_peak_mib == 32


INIT = (
    "Device MOC Size:65536M, Device free MOC Size:62345M, Reserved MOC size for Other "
    "Components(HCCL/rts/etc.):3072M, Reserved MOC size for Mindspore:1024M, User define "
    "MindSpore MOC Size:57G, MindSpore Used MOC Size:58368M."
)


@pytest.mark.parametrize("kind", ["MOC", "HBM"])
def test_device_init(kind: str) -> None:
    event = parse_line(
        "[INFO] DEVICE(77,7f,python):2025 [ascend_memory_adapter.cc:99] Initialize] "
        + INIT.replace("MOC", kind)
    )
    assert event == DeviceMemoryInit(
        memory_kind=kind,
        device_mib=65536,
        device_free_mib=62345,
        reserved_other_mib=3072,
        user_define_mib=57 * 1024,
        mindspore_used_mib=58368,
    )


@pytest.mark.parametrize(
    ("text", "stat", "value"),
    [
        ("Device MOC memory size: 65536M", MemoryStatKind.DEVICE, 65536),
        ("Device HBM memory size: 65536M", MemoryStatKind.DEVICE, 65536),
        ("MindSpore Used memory size: 58368M", MemoryStatKind.MINDSPORE_USED, 58368),
        ("Used peak memory usage (without fragments): 29331M", MemoryStatKind.USED_PEAK, 29331),
        ("Actual peak memory usage (with fragments): 29614M", MemoryStatKind.ACTUAL_PEAK, 29614),
        (
            "[MS_RUNTIME_PROF]Actual peak memory usage (with fragments): 29614M",
            MemoryStatKind.ACTUAL_PEAK,
            29614,
        ),
    ],
)
def test_deinit_statistics(text: str, stat: MemoryStatKind, value: int) -> None:
    assert parse_line(
        "[INFO] DEVICE(77,7f,python):2025 [a.cc:1] DeInitialize] " + text
    ) == MemoryStat(stat, value)


OOM_CASES = [
    pytest.param(
        "[ERROR] RUNTIME_FRAMEWORK(4301,7fe1,python):2026 [memory_manager_actor.cc:515] "
        "SetOpContextMemoryAllocFail] #umsg#Memory not enough:#umsg#Device(id:0) memory "
        "isn't enough and alloc failed, kernel name: Default/FlashAttention-op12, "
        "alloc size: 2147483648B.",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 2147483648, "kernel": "Default/FlashAttention-op12"},
        id="ascend-alloc-failed",
    ),
    pytest.param(
        "Memory isn't enough and alloc failed, kernel name: 0_Default/0-Dense/MatMul-op0, "
        "alloc size: 6144000000B.",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 6144000000, "kernel": "0_Default/0-Dense/MatMul-op0"},
        id="cpu-alloc-failed",
    ),
    pytest.param(
        "Out of Memory!!! Request memory size: 1073741824B, Memory Statistic: Device HBM memory "
        "size: 65536M",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 1073741824},
        id="out-of-memory",
    ),
    pytest.param(
        "Memory not enough: current free memory size[1024] is smaller than required size[4096].",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 4096},
        id="free-smaller",
    ),
    pytest.param(
        "[WARNING] PRE_ACT(4301,7fe1,python):2026 [mem_dynamic_allocator.cc:521] "
        "AddMemBlockAndMemBuf] Memory not enough: alloc size[0] is smaller than required "
        "size[6144000000].",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 6144000000},
        id="ms210-add-block",
    ),
    pytest.param(
        "RuntimeError: The Free Device Memory Size is 60.5 GB, max_device_memory should be in "
        "range (0-61952]MB, but got 62000MB.",
        OomKind.MAX_DEVICE_MEMORY_RANGE,
        {
            "free_device_gib": 60.5,
            "max_device_memory_limit_mib": 61952.0,
            "max_device_memory_requested_mib": 62000.0,
        },
        id="max-device-memory",
    ),
    pytest.param(
        "torch.OutOfMemoryError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.96 GiB "
        "total capacity; 55.12 GiB already allocated)",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 2 * 2**30},
        id="torch-npu",
    ),
    pytest.param(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a "
        "total capacity of 79.15 GiB",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 512 * 2**20},
        id="cuda",
    ),
    pytest.param(
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
        OomKind.KV_BLOCKS_EXHAUSTED,
        {},
        id="no-cache-blocks",
    ),
    pytest.param(
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (21504). Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine.",
        OomKind.MAX_MODEL_LEN_TOO_LARGE,
        {"max_model_len": 32768, "kv_cache_tokens": 21504},
        id="v0-seq-too-long",
    ),
    pytest.param(
        "ValueError: To serve at least one request with the models's max seq len (32768), "
        "(4.00 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(2.62 GiB). Based on the available memory, the estimated maximum model length is "
        "21456. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
        "initializing the engine.",
        OomKind.MAX_MODEL_LEN_TOO_LARGE,
        {"max_model_len": 32768, "estimated_max_model_len": 21456},
        id="v1-estimated",
    ),    pytest.param(
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate "
        "memory)",
        OomKind.DEVICE_OOM,
        {"alloc_bytes": 8 * 2**30, "message": "DefaultCPUAllocator: can't allocate memory: you "
         "tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"},
        id="vllm-cpu-allocator",
    ),
]


@pytest.mark.parametrize(("text", "kind", "fields"), OOM_CASES)
def test_oom(text: str, kind: OomKind, fields: dict[str, object]) -> None:
    event = parse_line(text)
    assert isinstance(event, OomEvent)
    assert event.kind is kind
    for name, value in fields.items():
        assert getattr(event, name) == value
    assert event.message
    assert event.message in text


VLLM = "INFO 05-16 23:06:54 [gpu_model_runner.py:1595] "
VLLM_CASES = [
    pytest.param(
        VLLM + "Starting to load model /models/Qwen3-8B...", LoadingStarted(), id="load-start"
    ),
    pytest.param(
        VLLM + "Model loading took 9.1948 GiB and 5.42 seconds",
        ModelLoaded(9.1948, 5.42),
        id="model-loading",
    ),
    pytest.param(
        VLLM + "Model loading took 56.88 GiB memory and 0.842889 seconds",
        ModelLoaded(56.88, 0.842889),
        id="model-loading-memory",
    ),
    pytest.param(
        "INFO 05-16 23:06:54 model_runner.py:1115] Loading model weights took 27.5376 GB",
        ModelLoaded(27.5376, None),
        id="ascend-weights",
    ),
    pytest.param(
        VLLM + "Available KV cache memory: 44.30 GiB", AvailableKvMemory(44.30), id="kv-gib"
    ),
    pytest.param(
        VLLM + "Available KV cache memory: -1.25 GiB", AvailableKvMemory(-1.25), id="kv-negative"
    ),
    pytest.param(
        "INFO 05-16 23:06:54 worker.py:250] "
        "Available memory: 53405099008, total memory: 65452113920",
        AvailableMemory(53405099008, 65452113920),
        id="ascend-raw-bytes",
    ),
    pytest.param(VLLM + "GPU KV cache size: 645,120 tokens", KvCacheSize(645120), id="kv-tokens"),
    pytest.param(VLLM + "NPU KV cache size: 7,216 tokens", KvCacheSize(7216), id="npu-kv-tokens"),
    pytest.param(
        VLLM + "CPU KV cache size: 1,048,576 tokens, Maximum concurrency for 4,096 tokens per "
        "request: 256.00x",
        KvCacheSize(1048576, MaxConcurrency(4096, 256.0)),
        id="cpu-kv-tokens-and-concurrency",
    ),
    pytest.param(
        VLLM + "Maximum concurrency for 4,096 tokens per request: 265.25x",
        MaxConcurrency(4096, 265.25),
        id="concurrency",
    ),
    pytest.param(
        "INFO 05-16 23:06:54 worker.py:240] "
        "the rest of the memory reserved for KV Cache is 1.57GiB.",
        KvReserved(1.57),
        id="v0-reserved",
    ),
    pytest.param(
        "INFO 05-16 23:06:54 executor_base.py:110] # GPU blocks: 2964, # CPU blocks: 512",
        BlockCounts(2964, 512),
        id="v0-gpu-blocks",
    ),
    pytest.param(
        "INFO 05-16 23:06:54 executor_base.py:110] # npu blocks: 1200, # CPU blocks: 256",
        BlockCounts(1200, 256),
        id="v0-npu-blocks",
    ),
    pytest.param(
        "WARNING 05-16 23:06:54 scheduler.py:1097] Input prompt (16383 tokens) is too long and "
        "exceeds the capacity of block_manager",
        PromptIgnored(16383, None),
        id="v0-prompt-ignored-capacity",
    ),
    pytest.param(
        "WARNING 05-16 23:06:54 scheduler.py:1060] Input prompt (5000 tokens) is too long and "
        "exceeds limit of 4096",
        PromptIgnored(5000, 4096),
        id="v0-prompt-ignored-limit",
    ),    # V1 engines beyond their KV cache size
    pytest.param(
        VLLM + "Initial free memory 78.66 GiB, reserved 59.0 GiB memory for KV Cache as specified "
        "by kv_cache_memory_bytes config and skipped memory profiling.",
        KvPinned(78.66, 59.0),
        id="v1-pinned",
    ),
    pytest.param(
        VLLM + "Explicitly set (1.0/11.96) GiB for KV cache on node 0.",
        CpuKvSet(True, 1.0, 11.96, None),
        id="cpu-pinned",
    ),
    pytest.param(
        VLLM + "Auto set (2.7/11.34) GiB for KV cache on node 0, with 3.4 GiB requested memory "
        "for the worker. 0.7 GiB memory was consumed by non-kv usages.",
        CpuKvSet(False, 2.7, 11.34, 0.7),
        id="cpu-profiled",
    ),
    pytest.param(
        VLLM + "Graph capturing finished in 8 secs, took 1.01 GiB",
        GraphsCaptured(1.01),
        id="graphs",
    ),
    pytest.param(
        VLLM + "Chunked prefill is enabled with max_num_batched_tokens=8192.",
        ChunkedPrefill(8192),
        id="chunked-prefill",
    ),
    pytest.param(
        VLLM + "Encoder cache will be initialized with a budget of 2048 tokens, and profiled "
        "with 2 image items of the maximum feature size.",
        EncoderBudget(2048, 2),
        id="encoder-budget",
    ),
    pytest.param(
        "ValueError: Free memory on device cuda:0 (40.1/79.18 GiB) on startup is less than "
        "desired GPU memory utilization (0.9, 71.26 GiB). Decrease GPU memory utilization",
        DeviceRefused(40.1, 79.18, 0.9, 71.26),
        id="device-refused",
    ),
    pytest.param(
        VLLM + "non-default args: {'model': 'm', 'max_model_len': 32768, "
        "'kv_cache_memory_bytes': 63350767616}",
        EngineArgs(63350767616, 32768),
        id="args-pinned",
    ),
    pytest.param(
        VLLM + "non-default args: {'model': 'm', 'max_model_len': 4096}",
        EngineArgs(None, 4096),
        id="args-profiled",
    ),
    pytest.param(VLLM + "Using max model len 32768", EngineArgs(None, 32768), id="max-model-len"),
    pytest.param(
        VLLM + "Initializing a V1 LLM engine (v0.24.0) with config: model='m', "
        "tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1",
        V1EngineConfig(2, 1),
        id="v1-config",
    ),
    pytest.param(
        VLLM + "Starting vLLM server on http://0.0.0.0:8011", ServerReady(), id="ready"
    ),
    pytest.param("INFO:     Application startup complete.", ServerReady(), id="ready-uvicorn"),
    pytest.param("ERROR [core.py:1231] EngineCore failed to start.", EngineStartFailed(None),
                 id="start-failed"),
    pytest.param(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {'EngineCore_DP0': -9}",
        EngineStartFailed(9),
        id="start-killed",
    ),
    pytest.param(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}",
        EngineStartFailed(None),
        id="start-failed-api",
    ),
    pytest.param("ERROR [core.py:1233] EngineCore encountered a fatal error.", EngineDied(),
                 id="engine-dead"),
    pytest.param(
        "ERROR [dump_input.py:79] Dumping scheduler output for model execution: "
        "SchedulerOutput(scheduled_new_reqs=[NewRequestData(req_id=x)], ...)",
        SchedulerDump(True),
        id="died-on-prefill",
    ),
    pytest.param(
        "ERROR [dump_input.py:79] Dumping scheduler output for model execution: "
        "SchedulerOutput(scheduled_new_reqs=[], ...)",
        SchedulerDump(False),
        id="died-on-decode",
    ),
]


@pytest.mark.parametrize(("text", "expected"), VLLM_CASES)
def test_vllm_lines(text: str, expected: object) -> None:
    assert parse_line(text) == expected
    assert parse_line(("(VllmWorker rank=1 pid=5361) " + text + "\r\n").encode()) == expected


ORIGIN_CASES = [
    pytest.param(PREFIX, Origin(1234, None), id="ms-cpp"),
    pytest.param(
        "[INFO] ME(3764:139933315009408,MainProcess):2026 [x.py:1] y",
        Origin(3764, None),
        id="ms-python",
    ),
    pytest.param(
        "(VllmWorker rank=3 pid=5361) INFO 05-16 23:06:54 [a.py:1] x",
        Origin(5361, 3),
        id="vllm-worker",
    ),
    pytest.param(
        "(EngineCore_DP0 pid=1102) INFO 05-16 23:06:54 [a.py:1] x",
        Origin(1102, None),
        id="engine-core",
    ),
    pytest.param(
        "(VllmWorkerProcess pid=507) INFO 05-16 23:06:54 a.py:1] x",
        Origin(507, None),
        id="v0-worker",
    ),
    pytest.param(
        "(VllmWorker TP2 pid=88) INFO 05-16 23:06:54 [a.py:1] x", Origin(88, 2), id="vllm-tp-tag"
    ),
    pytest.param("Memory isn't enough and alloc failed", Origin(None, None), id="bare"),
]


@pytest.mark.parametrize(("text", "expected"), ORIGIN_CASES)
def test_origin(text: str, expected: Origin) -> None:
    assert parse_origin(text) == expected
    assert parse_origin(text.encode()) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        PREFIX + "The dynamic memory pool total size is: 1024M, total used size is 4M",
        PREFIX + f"The dynamic memory pool stat info : {STAT}",  # the debug dump: no peak
        "- Memory not enough:",
        "actual peak used mem:",
        "Available KV cache memory: lots",
        "INFO something else entirely",
    ],
)
def test_not_memory_lines(text: str) -> None:
    assert parse_line(text) is None


def test_every_case_holds_an_anchor() -> None:
    """The scanner only parses lines with an anchor: every kind above must carry one."""
    cases = [p.values[0] for p in POOL_CASES + OOM_CASES + VLLM_CASES]
    cases += [INIT, INIT.replace("MOC", "HBM"), "Used peak memory usage (without fragments): 1M"]
    for text in cases:
        assert isinstance(text, str)
        assert any(a.decode() in text for a in ANCHORS), text


def test_invalid_utf8_and_cr() -> None:
    line = (
        PREFIX.encode()
        + b"\xff\xfe The dynamic memory pool total allocated mem:10M, actual peak used mem:7M\r\n"
    )
    event = parse_line(line)
    assert isinstance(event, PoolDump)
    assert event.actual_peak_mib == 7
