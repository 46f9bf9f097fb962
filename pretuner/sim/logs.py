"""Log lines as vLLM 0.6 and MindSpore print them, and the per-rank writers of the emulator.

MindSpore C++ lines honour `GLOG_v` and go to stderr, or with `GLOG_logtostderr=0` to
`$GLOG_log_dir/rank_<RANK_ID>/logs/` under MindSpore 2.10's file names."""

from __future__ import annotations

import datetime as dt
import getpass
import os
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

POOL_FORMATS = ("2.5", "2.6", "bestfit")
LEVELS = {"DEBUG": 0, "INFO": 1, "WARNING": 2, "ERROR": 3}

_POOL_SRC = "mindspore/ccsrc/memory/mem_pool/abstract_dynamic_mem_pool.cc:1029"
_ADAPTER_SRC = "mindspore/ccsrc/plugin/device/ascend/hal/device/ascend_memory_adapter.cc"


def ms_prefix(level: str, module: str, pid: int, tid: int, when: dt.datetime, src: str,
              func: str) -> str:
    """`[INFO] PRE_ACT(pid,tid_hex,python):YYYY-MM-DD-HH:MM:SS.mmm.uuu [src:line] Func] `."""
    stamp = when.strftime("%Y-%m-%d-%H:%M:%S")
    ms, us = divmod(when.microsecond, 1000)
    return f"[{level}] {module}({pid},{tid:x},python):{stamp}.{ms:03d}.{us:03d} [{src}] {func}] "


def vllm_prefix(level: str, when: dt.datetime, src: str) -> str:
    """vLLM 0.6/0.7: `INFO 05-16 23:06:54 file.py:123] `."""
    return f"{level} {when.strftime('%m-%d %H:%M:%S')} {src}] "


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What a rank's pool dump reports, in bytes."""

    in_used: int
    peak_used: int  # without fragments
    actual_peak: int  # with fragments: the figure the method reads
    alloc: int

    @property
    def idle(self) -> int:
        return max(0, self.alloc - self.in_used)


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}MB"


def _m(n: int) -> str:
    return f"{n // 2**20}M"


def pool_dump(stats: PoolStats, fmt: str) -> str:
    """The dynamic memory pool's stat line in the given MindSpore format."""
    tail = (f"Weight used size:0M, constant value used size:0M, kernel output used size:0M, "
            f"other used size:{_m(stats.in_used)}.")
    if fmt == "bestfit":
        return (f"The dynamic memory pool total allocated mem:{_m(stats.alloc)}, min addr :0, "
                f"max addr: 0, peak used mem:{_m(stats.peak_used)}, actual peak used mem:"
                f"{_m(stats.actual_peak)}, in used mem:{_m(stats.in_used)}, total used by event "
                f"mem:0M, total idle mem:{_m(stats.idle)}, total eager free mem:0M. {tail}")
    body = (f'{{"in used mem":{_mb(stats.in_used)},"peak used mem":{_mb(stats.peak_used)},'
            f'"alloc mem":{_mb(stats.alloc)},"idle mem":{_mb(stats.idle)},'
            f'"used by event mem":0.00MB,"eager free mem":0.00MB}}')
    name = "" if fmt == "2.5" else "[DefaultAscendMemoryPool]"
    return (f"The dynamic memory pool{name} stat info : {body}, actual peak used mem:"
            f"{_m(stats.actual_peak)}. {tail}")


def glog_level(env: Mapping[str, str] | None = None) -> int:
    """GLOG_v as MindSpore reads it; the emulator defaults to 3 (ERROR) like vllm-mindspore."""
    raw = (os.environ if env is None else env).get("GLOG_v", "3")
    try:
        return int(raw)
    except ValueError:
        return 3


class LineLog:
    """Whole lines to one stream (stderr unless run in-process), safe across threads."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._lock = threading.Lock()

    def _write(self, text: str) -> None:
        with self._lock:
            self._stream.write(text if text.endswith("\n") else text + "\n")
            self._stream.flush()


class VllmLog(LineLog):
    """vLLM's Python logger (always stderr) and uvicorn's plain lines."""

    def log(self, level: str, src: str, msg: str) -> None:
        self._write(vllm_prefix(level, dt.datetime.now(), src) + msg)

    def info(self, src: str, msg: str) -> None:
        self.log("INFO", src, msg)

    def warning(self, src: str, msg: str) -> None:
        self.log("WARNING", src, msg)

    def error(self, src: str, msg: str) -> None:
        self.log("ERROR", src, msg)

    def uvicorn(self, msg: str, level: str = "INFO") -> None:
        self._write(f"{level + ':':<9} {msg}")


class RankLog:
    """One emulated rank's MindSpore C++ log (and its Python-side log when writing files); on
    a Ray cluster, `pretuner.sim.raynodes.RemoteRankLog` sends its lines to the rank's node."""

    def __init__(self, rank: int, pid: int, tid: int, log_dir: Path | None,
                 stderr: TextIO | None = None, level: int | None = None) -> None:
        self.rank = rank
        self.pid = pid
        self.tid = tid
        self.level = glog_level() if level is None else level
        self._lock = threading.Lock()
        self._own: list[TextIO] = []
        self._stream: TextIO
        self._py: TextIO
        if log_dir is None:
            self._stream = self._py = stderr or sys.stderr
            return
        logs = log_dir / f"rank_{rank}" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"mindspore.{socket.gethostname()}.{_user()}.log.INFO.{stamp}.{pid}"
        self._stream = open(logs / name, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._py = open(logs / f"mindspore.log.{pid}", "a", encoding="utf-8")  # noqa: SIM115
        self._own = [self._stream, self._py]
        link = logs / "mindspore.INFO"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(name)

    def log(self, level: str, module: str, src: str, func: str, msg: str) -> None:
        if LEVELS[level] < self.level:
            return
        line = ms_prefix(level, module, self.pid, self.tid, dt.datetime.now(), src, func) + msg
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def py(self, level: str, msg: str, src: str = "mindspore/context.py:1052") -> None:
        """A MindSpore Python-side line: `[WARNING] ME(pid:tid,MainProcess):... [src] msg`."""
        if LEVELS[level] < self.level:
            return
        now = dt.datetime.now()
        ms, us = divmod(now.microsecond, 1000)
        stamp = now.strftime("%Y-%m-%d-%H:%M:%S") + f".{ms:03d}.{us:03d}"
        with self._lock:
            self._py.write(
                f"[{level}] ME({self.pid}:{self.tid},MainProcess):{stamp} [{src}] {msg}\n")
            self._py.flush()

    def noise(self, phase: str, count: int) -> None:
        """INFO chatter like a real GLOG_v=1 run prints, for parsers to wade through."""
        lines = _NOISE[phase]
        for i in range(count):
            module, src, func, text = lines[i % len(lines)]
            self.log("INFO", module, src, func, text.format(i=i, size=(i + 1) * 2097152))

    def adapter_init(self, total_mib: int, free_bytes: int, cap_bytes: int, user_gb: float) -> None:
        others = total_mib * 2**20 - cap_bytes
        recommend = int(free_bytes * 0.05)
        self.log("INFO", "DEVICE", f"{_ADAPTER_SRC}:218", "Initialize",
                 f"Device MOC Size:{total_mib}M, Device free MOC Size:{free_bytes // 2**20}M, "
                 f"Reserved MOC size for Other Components(HCCL/rts/etc.):{others // 2**20}M, "
                 f"Recommend Reserved MOC size for Other Components:{recommend // 2**20}M, "
                 f"User define MindSpore MOC Size:{user_gb:g}G, "
                 f"MindSpore Used MOC Size:{cap_bytes // 2**20}M.")

    def pool_dump(self, stats: PoolStats, fmt: str) -> None:
        self.log("INFO", "PRE_ACT", _POOL_SRC, "DumpDynamicMemPoolStateInfo",
                 pool_dump(stats, fmt))

    def deinit(self, total_mib: int, cap: int, stats: PoolStats) -> None:
        self.log("INFO", "DEVICE", f"{_ADAPTER_SRC}:271", "DeInitialize",
                 "Ascend Memory Adapter deinitialize success, statistics:\n"
                 f"Device MOC memory size: {total_mib}M\n"
                 f"MindSpore Used memory size: {_m(cap)}\n"
                 f"Used peak memory usage (without fragments): {_m(stats.peak_used)}\n"
                 f"Actual peak memory usage (with fragments): {_m(stats.actual_peak)}")

    def close(self) -> None:
        for f in self._own:
            f.close()
        self._own = []


_NOISE: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "start": (
        ("ME", "mindspore/ccsrc/pipeline/jit/ps/pipeline.cc:1274", "CompileInner",
         "Start compiling, phase: predict.{i}"),
        ("KERNEL", "mindspore/ccsrc/plugin/device/ascend/kernel/opapi/aclnn_kernel_mod.cc:96",
         "Init", "Kernel MatMul-op{i} use aclnn, workspace size: {size}"),
        ("PRE_ACT", "mindspore/ccsrc/memory/mem_pool/mem_dynamic_allocator.cc:412",
         "AllocTensorMem", "Malloc Memory: Size {size}, used by event false, stream id 0"),
        ("DEVICE", "mindspore/ccsrc/plugin/device/ascend/hal/hardware/ge_graph_executor.cc:688",
         "CompileGraph", "Graph predict.{i} compile end, cost 12 ms"),
        ("ME", "mindspore/ccsrc/backend/graph_compiler/backend.cc:590", "CompileGraph",
         "Status record: end compile graph predict.{i}"),
    ),
    "step": (
        ("RUNTIME_FRAMEWORK", "mindspore/ccsrc/runtime/graph_scheduler/graph_scheduler.cc:722",
         "Run", "Start run graph: predict.{i}"),
        ("PRE_ACT", "mindspore/ccsrc/memory/mem_pool/mem_dynamic_allocator.cc:412",
         "AllocTensorMem", "Malloc Memory: Size {size}, used by event false, stream id 0"),
    ),
}


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "root"
