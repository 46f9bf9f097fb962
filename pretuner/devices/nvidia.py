"""NVIDIA cards: NVML through pynvml (the optional `nvidia-ml-py`), else `nvidia-smi`.

`nvidia-smi --query-gpu=… -lms 20` is one long-running nvidia-smi printing every GPU's memory
every 20 ms, read on a thread, instead of one nvidia-smi started per sample. Each `sample()`
returns, per GPU, the highest used MiB printed since the previous `sample()`, so a spike
between two samples is not lost. An nvidia-smi that does not loop (it rejects `-lms`, or
prints once and exits 0) is run once per sample instead (`NvidiaSmiReader`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, cast

from pretuner.devices.base import (
    FASTEST_INTERVAL_S,
    CommandReader,
    DeviceMemory,
    DeviceReadError,
    Holder,
    Sample,
    keep,
    run_tool,
)
from pretuner.procgroups import describe_exit, group_alive, kill_group, wait_group_gone
from pretuner.units import MIB

log = logging.getLogger(__name__)

QUERY = ("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")


def parse_nvidia_smi_csv(text: str) -> tuple[DeviceMemory, ...]:
    """`nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`:
    one `0, 1234, 81559` row per GPU (MiB); rows that are not that ("[N/A]") are skipped."""
    found = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 3 and all(c.isdigit() and len(c) <= 10 for c in cells):
            found.append(DeviceMemory(int(cells[0]), int(cells[1]), int(cells[2])))
    return tuple(found)


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One row of an NVML series file."""

    epoch_s: float
    run: str | None
    phase: str
    used_mib: int


def parse_nvml_series(text: str) -> tuple[SeriesPoint, ...]:
    """An NVML series (`epoch_s<TAB>[run:]phase<TAB>used_mib`); malformed rows are skipped."""
    points = []
    for line in text.splitlines():
        cells = line.strip().split("\t")
        if len(cells) != 3 or not cells[2].isdigit() or len(cells[2]) > 10:
            continue
        try:
            epoch = float(cells[0])
        except ValueError:
            continue
        run, _, phase = cells[1].rpartition(":")
        points.append(SeriesPoint(epoch, run or None, phase, int(cells[2])))
    return tuple(points)


def series_peaks(points: tuple[SeriesPoint, ...]) -> dict[str, int]:
    """The peak used MiB of each phase of a series."""
    peaks: dict[str, int] = {}
    for p in points:
        peaks[p.phase] = max(peaks.get(p.phase, 0), p.used_mib)
    return peaks


def gpu_identity(index: int, exe: str | None = None) -> tuple[str, int] | None:
    """GPU `index`: (name, total MiB) as nvidia-smi (`exe`, else the one on PATH) prints them;
    None when it does not answer."""
    exe = exe or shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = run_tool([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                         "-i", str(index)], 30.0)
    except DeviceReadError:
        return None
    name, _, total = text.strip().partition("\n")[0].rpartition(",")
    return (name.strip(), int(total)) if total.strip().isdigit() else None


class NvidiaSmiReader(CommandReader):
    """`nvidia-smi --query-gpu=…` run once per sample: as fast as the command answers."""

    name = "nvidia-smi"
    args = QUERY
    parse = staticmethod(parse_nvidia_smi_csv)

    def device_name(self) -> str | None:
        """The first of the devices (GPU 0 when all) by name, as nvidia-smi prints it."""
        found = gpu_identity(min(self.devices or {0}), self.executable)
        return found[0] if found is not None else None


def load_nvml() -> Any | None:
    """The pynvml module, initialised; None when it is not installed or finds no driver."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_*: no driver, no GPU
        return None
    return pynvml


class NvmlReader:
    """NVML in-process: cheap enough for every 20 ms."""

    name = "nvml"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, nvml: Any, devices: frozenset[int] | None = None) -> None:
        self.nvml = nvml
        count = int(nvml.nvmlDeviceGetCount())
        wanted = range(count) if devices is None else sorted(d for d in devices if d < count)
        self.handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in wanted]

    def sample(self) -> Sample | None:
        found = []
        try:
            for index, handle in self.handles:
                info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                found.append(DeviceMemory(index, int(info.used) // MIB, int(info.total) // MIB))
        except Exception as err:  # NVMLError_*: the library's own hierarchy
            raise DeviceReadError(f"NVML: {err}") from err
        return Sample(tuple(found)) if found else None

    def device_name(self) -> str | None:
        if not self.handles:
            return None
        try:
            name = self.nvml.nvmlDeviceGetName(self.handles[0][1])
        except Exception as err:  # NVMLError_*
            raise DeviceReadError(f"NVML: {err}") from err
        return name.decode() if isinstance(name, bytes) else str(name)  # bytes before 11.515

    def holders(self) -> tuple[Holder, ...]:
        found = []
        try:
            for index, handle in self.handles:
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = int(proc.usedGpuMemory or 0) // MIB
                    found.append(Holder(index, int(proc.pid), _process_name(proc.pid), used))
        except Exception as err:  # NVMLError_*: no verdict on holders, the sample still stands
            raise DeviceReadError(f"NVML: {err}") from err
        return tuple(found)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip() or "?"
    except OSError:
        return "?"  # another container's process: NVML sees it, /proc does not


LOOP_MS = round(FASTEST_INTERVAL_S * 1000)  # nvidia-smi prints as often as we sample
TERM_WAIT_S = 2.0  # after SIGTERM, before SIGKILL
KILL_WAIT_S = 2.0
DRAIN_S = 1.0  # how long the output of an exited nvidia-smi is waited for
EXIT_WAIT_S = 5.0  # how long one whose output ended may take to be reaped (a loaded host)
# A sample() this long after the previous one (a new launch, a reader left idle) returns the
# latest rows, not the highest since then: those rows describe a time nobody was measuring.
STALE_GAP_S = 1.0
LINE_MAX_BYTES = 4096  # a longer line is read in pieces (memory stays bounded)
TAIL_LINES = 8  # lines that were not rows (usage text, errors), kept for the error message


class _Stream:
    """The running nvidia-smi and what its thread has read. Holds no reference to the reader,
    so a reader that is dropped is finalized (and its nvidia-smi stopped)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.cond = threading.Condition()
        self.peak: dict[int, DeviceMemory] = {}  # highest used per GPU since the last take
        self.latest: dict[int, DeviceMemory] = {}
        self.rows = 0
        self.blocks = 0  # complete blocks (one row per GPU) read
        self.eof = False
        self.last_row_s: float | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.stopped = False
        self._previous: int | None = None  # the index of the row read last
        try:
            # stderr joins stdout: one pipe, drained by one thread; the parser skips non-rows.
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         close_fds=True)
        except OSError as err:
            raise DeviceReadError(f"{shlex.join(argv)}: {err}") from err
        self.started_s = time.monotonic()
        out = cast(IO[bytes], self.proc.stdout)  # stdout=PIPE: never None
        self.thread = threading.Thread(target=self._read, args=(out,),
                                       name="nvidia-smi-stream", daemon=True)
        self.thread.start()

    def _read(self, out: IO[bytes]) -> None:
        try:
            while raw := out.readline(LINE_MAX_BYTES):
                line = raw.decode("utf-8", errors="replace")
                rows = parse_nvidia_smi_csv(line)
                with self.cond:
                    if not rows:
                        if line.strip():
                            self.tail.append(line.strip()[:200])
                        continue
                    for row in rows:
                        self._add(row)
                    self.last_row_s = time.monotonic()
                    self.cond.notify_all()
        except (OSError, ValueError):  # the pipe closed under us by stop()
            pass
        finally:
            with self.cond:
                self.eof = True
                if self.rows:
                    self.blocks += 1  # the last block ends with the output
                self.cond.notify_all()
            with contextlib.suppress(OSError):
                out.close()

    def _add(self, row: DeviceMemory) -> None:
        # GPUs are listed in index order: an index not above the last one starts a new block.
        if self._previous is not None and row.device <= self._previous:
            self.blocks += 1
        self._previous = row.device
        self.rows += 1
        self.latest[row.device] = row
        held = self.peak.get(row.device, row)
        self.peak[row.device] = replace(row, used_mib=max(held.used_mib, row.used_mib))

    def exit_code(self) -> int | None:
        """The exit code once nvidia-smi has exited (its output read); None while it runs."""
        code = self.proc.poll()
        if code is None and self.eof:
            # Its output has ended, so it is exiting: under load the kernel may not have
            # reaped it yet, and a None here would read as "still looping, no rows yet".
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(EXIT_WAIT_S)
        if code is None:
            return None
        self.thread.join(DRAIN_S)  # the rest of its output
        return code

    def stop(self) -> None:
        """SIGTERM the process group, wait TERM_WAIT_S, then SIGKILL; idempotent."""
        self.stopped = True
        pgid = self.proc.pid  # start_new_session: the group is the leader's pid
        if self.proc.poll() is None or group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            if not wait_group_gone(pgid, time.monotonic() + TERM_WAIT_S, reap=self.proc.poll):
                kill_group(pgid, self.proc.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(KILL_WAIT_S)
        self.thread.join(DRAIN_S)


class NvidiaSmiStreamReader:
    """`nvidia-smi --query-gpu=… -lms 20` started on the first sample and read as it prints;
    `close()` (or the end of pretuner) stops it."""

    name = "nvidia-smi"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, executable: str, devices: frozenset[int] | None = None,
                 timeout_s: float = 10.0, loop_ms: int = LOOP_MS) -> None:
        self.executable = executable
        self.devices = devices
        self.timeout_s = timeout_s  # the longest wait for a row before it counts as hung
        self.argv = [executable, *QUERY, "-lms", str(loop_ms)]
        self.once = NvidiaSmiReader(executable, devices, timeout_s)  # names the GPU too
        self.looping = True  # False once nvidia-smi is found not to loop: `once` samples then
        self._stream: _Stream | None = None
        self._stop_stream: weakref.finalize[[], NvidiaSmiStreamReader] | None = None
        self._last_take_s: float | None = None

    def device_name(self) -> str | None:
        return self.once.device_name()

    def sample(self) -> Sample | None:
        if not self.looping:
            return self.once.sample()
        stream = self._stream if self._stream is not None else self._start()
        with stream.cond:
            if self._last_take_s is None:
                # The first sample waits for every GPU: a caller may sample only once (to
                # learn the card's size).
                stream.cond.wait_for(lambda: stream.blocks > 0 or stream.eof, self.timeout_s)
        code = stream.exit_code()
        found = self._take(stream)
        if stream.stopped:
            raise DeviceReadError(f"{shlex.join(self.argv)}: the reader was closed")
        if found:
            return keep(found, self.devices)
        if code is not None:
            return self._exited(stream, code)
        if time.monotonic() - (stream.last_row_s or stream.started_s) > self.timeout_s:
            self.close()
            raise DeviceReadError(f"{shlex.join(self.argv)} printed no GPU row for "
                                  f"{self.timeout_s:g} s")
        return None

    def close(self) -> None:
        """Stop nvidia-smi (its whole process group); a later sample() starts a new one."""
        if self._stop_stream is not None:
            self._stop_stream()  # once: a finalize object calls its function at most once
        self._stream = self._stop_stream = None
        self._last_take_s = None

    def _start(self) -> _Stream:
        stream = _Stream(self.argv)
        self._stream = stream
        # Called by close(), when the reader is dropped, or at exit: no nvidia-smi outlives
        # pretuner.
        self._stop_stream = weakref.finalize(self, stream.stop)
        return stream

    def _take(self, stream: _Stream) -> tuple[DeviceMemory, ...]:
        """The rows since the last take (each GPU's highest), and start a new window."""
        now = time.monotonic()
        with stream.cond:
            stale = self._last_take_s is not None and now - self._last_take_s > STALE_GAP_S
            chosen = stream.latest if stale else stream.peak
            found = tuple(chosen[i] for i in sorted(chosen)) if stream.peak else ()
            stream.peak = {}
        self._last_take_s = now
        return found

    def _exited(self, stream: _Stream, code: int) -> Sample | None:
        """nvidia-smi has exited and every row it printed was returned: run once per sample
        when it never looped, else fail (the next sample starts a new one)."""
        rows, tail = stream.rows, " | ".join(stream.tail)
        self.close()
        if rows == 0 or code == 0:
            log.info("%s %s after %d rows%s; running nvidia-smi once per sample instead",
                     shlex.join(self.argv), describe_exit(code), rows,
                     f" ({tail})" if tail else "")
            self.looping = False
            return self.once.sample()
        raise DeviceReadError(f"{shlex.join(self.argv)} {describe_exit(code)}"
                              + (f": {tail}" if tail else ""))
