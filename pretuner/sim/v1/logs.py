"""vLLM 0.24's log lines: process prefixes, torch's out-of-memory text, failure tracebacks.

The tuner's scanner reads these, so they follow ../shared/real-logs/vllm-0.24-h100/ character
for character where it matters."""

from __future__ import annotations

import datetime as dt
from typing import TextIO

from pretuner.sim.logs import LineLog
from pretuner.units import GIB, MIB

VERSION = "0.24.0"
API = "APIServer"
CORE = "EngineCore"
WHERE_START = "core.py:1231"  # EngineCore failed to start
WHERE_FATAL = "core.py:1233"  # EngineCore encountered a fatal error
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
_FRAGMENT_HINT = (
    "If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/"
    "cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def prefix(who: str, pid: int, level: str, src: str, when: dt.datetime) -> str:
    """`(APIServer pid=1587) INFO 11-22 23:12:09 [api_utils.py:273] `."""
    return f"({who} pid={pid}) {level} {when.strftime('%m-%d %H:%M:%S')} [{src}] "


def torch_size(n_bytes: float) -> str:
    """torch's `format_size`: bytes up to 1 KiB, then KiB, MiB, GiB."""
    if n_bytes <= 1024:
        return f"{int(n_bytes)} bytes"
    if n_bytes <= MIB:
        return f"{n_bytes / 1024:.2f} KiB"
    if n_bytes <= GIB:
        return f"{n_bytes / MIB:.2f} MiB"
    return f"{n_bytes / GIB:.2f} GiB"


def oom_text(*, gpu: int, alloc: int, total: int, free: int, in_use: int, non_torch: int,
             private: int, unallocated: int) -> str:
    """torch.OutOfMemoryError's message, as torch 2.9 words it."""
    allocated = max(0, in_use - non_torch - unallocated)
    return (f"CUDA out of memory. Tried to allocate {torch_size(alloc)}. GPU {gpu} has a total "
            f"capacity of {torch_size(total)} of which {torch_size(max(0, free))} is free. "
            f"Including non-PyTorch memory, this process has {torch_size(in_use)} memory in "
            f"use. Of the allocated memory {torch_size(allocated)} is allocated by PyTorch, "
            f"with {torch_size(private)} allocated in private pools (e.g., CUDA Graphs), and "
            f"{torch_size(unallocated)} is reserved by PyTorch but unallocated. "
            + _FRAGMENT_HINT)


def _frames(frames: tuple[tuple[str, int, str, str], ...]) -> list[str]:
    out = []
    for path, line, func, code in frames:
        out.append(f'  File "{path}", line {line}, in {func}')
        if code:
            out.append(f"    {code}")
    return out


_CORE_HEAD = (
    ("site-packages/vllm/v1/engine/core.py", 1200, "run_engine_core",
     "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
    ("site-packages/vllm/v1/engine/core.py", 133, "__init__",
     "kv_cache_config = self._initialize_kv_caches(vllm_config)"),
)
_WARMUP = ("site-packages/vllm/v1/worker/gpu_worker.py", 735, "compile_or_warm_up_model",
           "warmup_kernels(self.model_runner, self.execute_model, self.sample_tokens)")
START_FRAMES: dict[str, tuple[tuple[str, int, str, str], ...]] = {
    "config": (("site-packages/vllm/v1/engine/core.py", 311, "_initialize_kv_caches",
                "kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs,"),
               ("site-packages/vllm/v1/core/kv_cache_utils.py", 712,
                "check_enough_kv_cache_memory", "raise ValueError(")),
    "free": (("site-packages/vllm/v1/worker/gpu_worker.py", 262, "init_device",
              "raise ValueError("),),
    "load": (("site-packages/vllm/v1/worker/gpu_worker.py", 297, "load_model",
              "self.model_runner.load_model(eep_scale_up=eep_scale_up)"),
             ("site-packages/vllm/model_executor/model_loader/dummy_loader.py", 24,
              "load_weights", "initialize_dummy_weights(model)")),
    "kv": (("site-packages/vllm/v1/worker/gpu_worker.py", 612, "initialize_from_config",
            "self.model_runner.initialize_kv_cache(kv_cache_config)"),
           ("site-packages/vllm/v1/worker/gpu/model_runner.py", 455, "initialize_kv_cache",
            "kv_caches = allocate_kv_cache(kv_cache_config, self.device)")),
    "graph": (("site-packages/vllm/v1/worker/gpu_worker.py", 658, "compile_or_warm_up_model",
               "cuda_graph_memory_bytes = self.model_runner.capture_model()"),
              ("site-packages/vllm/v1/worker/gpu/model_runner.py", 706, "capture_model",
               "attn_states = self.cudagraph_manager.capture("),
              ("site-packages/vllm/vllm_flash_attn/flash_attn_interface.py", 347,
               "flash_attn_varlen_func",
               "out, softmax_lse, _, _ = torch.ops._vllm_fa3_C.fwd(")),
    "warmup": (_WARMUP, ("site-packages/vllm/v1/worker/gpu/warmup.py", 231, "warmup_kernels",
                         "worker_execute_model(scheduler_output)")),
    "sampler": (_WARMUP, ("site-packages/vllm/v1/worker/gpu/warmup.py", 249, "warmup_kernels",
                          "worker_sample_tokens(grammar_output)"),
                ("site-packages/vllm/v1/worker/gpu/sample/sampler.py", 157,
                 "apply_sampling_params",
                 "logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)")),
}
STEP_FRAMES = (
    ("site-packages/vllm/v1/engine/core.py", 1224, "run_engine_core",
     "engine_core.run_busy_loop()"),
    ("site-packages/vllm/v1/engine/core.py", 1304, "_process_engine_step",
     "outputs, model_executed = self.step_fn()"),
    ("site-packages/vllm/v1/worker/gpu/model_runner.py", 1292, "execute_model",
     "model_output = self.model(**model_inputs)"),
    ("~/.cache/vllm/torch_compile_cache/inductor_cache/output_code.py", 412, "call",
     "buf3 = empty_strided_cuda((s72, {gate_up}), ({gate_up}, 1), torch.bfloat16)"),
)
_API_FRAMES = (
    ("site-packages/vllm/entrypoints/cli/serve.py", 148, "cmd", "uvloop.run(run_server(args))"),
    ("site-packages/vllm/entrypoints/openai/api_server.py", 663, "run_server",
     "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
    ("site-packages/vllm/v1/engine/core_client.py", 573, "__init__",
     "with launch_core_engines("),
    ("site-packages/vllm/v1/engine/utils.py", 1272, "wait_for_engine_startup",
     "raise RuntimeError("),
)


def start_failure_lines(stage: str, exc: str, message: str) -> tuple[list[str], list[str]]:
    """The EngineCore's two blocks for a failed start, as the real log shows both: (body
    after an ERROR prefix, body after the bare process prefix)."""
    frames = _frames(_CORE_HEAD + START_FRAMES[stage])
    body = ["Traceback (most recent call last):", *frames, f"{exc}: {message}"]
    raw = ["Process EngineCore:", "Traceback (most recent call last):",
           '  File "python3.12/multiprocessing/process.py", line 314, in _bootstrap',
           "    self.run()", *frames, f"{exc}: {message}"]
    return ["EngineCore failed to start.", *body], raw


def api_failure_lines(failed: str = "{}") -> list[str]:
    """The APIServer's traceback after a failed engine start (`failed`: the dead processes'
    exit codes, `{'EngineCore_DP0': -9}` for one killed by a signal)."""
    return ["Traceback (most recent call last):", *_frames(_API_FRAMES),
            "RuntimeError: Engine core initialization failed. See root cause above. Failed "
            f"core proc(s): {failed}"]


def fatal_step_lines(message: str, gate_up: int) -> list[str]:
    """`EngineCore encountered a fatal error.` and its traceback (ERROR-prefixed)."""
    frames = tuple((p, n, f, c.format(gate_up=gate_up)) for p, n, f, c in STEP_FRAMES)
    return ["EngineCore encountered a fatal error.", "Traceback (most recent call last):",
            *_frames(frames), f"torch.OutOfMemoryError: {message}"]


def dead_handler_lines() -> list[str]:
    """The APIServer's output handler noticing the dead engine."""
    return ["AsyncLLM output_handler failed.", "Traceback (most recent call last):",
            '  File "site-packages/vllm/v1/engine/async_llm.py", line 660, in output_handler',
            "    outputs = await engine_core.get_output_async()",
            f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD}"]


class V1Log(LineLog):
    """The API server's and the engine core's lines, each with its process prefix."""

    def __init__(self, api_pid: int, core_pid: int, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self.api_pid = api_pid
        self.core_pid = core_pid

    def _pid(self, who: str) -> int:
        return self.api_pid if who == API else self.core_pid

    def api(self, src: str, msg: str, level: str = "INFO") -> None:
        self.block(API, level, src, [msg])

    def core(self, src: str, msg: str, level: str = "INFO") -> None:
        self.block(CORE, level, src, [msg])

    def block(self, who: str, level: str, src: str, lines: list[str]) -> None:
        """A multi-line message: every line carries the prefix, as vLLM's logger prints it."""
        head = prefix(who, self._pid(who), level, src, dt.datetime.now())
        self._write("\n".join(head + line for line in lines))

    def raw(self, who: str, lines: list[str]) -> None:
        """Lines a process printed without the logger (tqdm bars, a bare traceback)."""
        self._write("\n".join(f"({who} pid={self._pid(who)}) {line}" for line in lines))

    def worker(self, pid: int, ip: str | None, src: str, msg: str) -> None:
        """A Ray worker's line as Ray's log monitor shows it in the driver's output (the ip
        only for a worker on another node)."""
        when = dt.datetime.now().strftime("%m-%d %H:%M:%S")
        where = f", ip={ip}" if ip else ""
        self._write(f"(RayWorkerWrapper pid={pid}{where}) INFO {when} [{src}] {msg}")

    def uvicorn(self, msg: str) -> None:
        self._write(f"({API} pid={self.api_pid}) INFO:     {msg}")
