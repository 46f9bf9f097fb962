"""Device memory sampled in the background during a launch: the peak of each phase, and a
time series of every device for the report's chart.

Memory stays bounded however long the launch: one peak per phase, and a `BoundedSeries`. A
reader that fails is logged once and sampling stops; the launch goes on, measured from its logs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pretuner.devices.base import FASTEST_INTERVAL_S, DeviceReader
from pretuner.devices.series import HEADER

log = logging.getLogger(__name__)

STOP_WAIT_S = 0.4  # how long stop() waits for a sample in flight (a slow command)
STATUS_EVERY_S = 1.0  # how often the memory seen so far is reported as a status
SERIES_MAX_POINTS = 3000  # samples kept per launch for the time series

# (phase, detail) -> None: how a launch reports its progress.
Phase = Callable[[str, str], None]
# Status updates that go through the phase callback without starting a phase: what the load's
# requests and the device's memory are at now. A live display shows them; nothing is tagged.
STATUS_EVENTS = frozenset({"requests", "memory"})


def requests_status(phase: Phase) -> Callable[[int, int], None]:
    """A load's `on_done(done, total)` that reports through `phase` as a status."""
    return lambda done, total: phase("requests", f"{done}/{total} done, "
                                                 f"{total - done} in flight")


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One sample of the time series: when, in which phase, each device's used MiB."""

    t_s: float  # seconds since the launch started
    phase: str
    used_mib: tuple[tuple[int, int], ...]  # (device, used MiB), as the reader listed them


class BoundedSeries:
    """A time series of at most `max_points` points: when full, every other point is dropped
    and the keep interval doubles (the peaks are kept elsewhere: a dropped point loses none)."""

    def __init__(self, max_points: int = SERIES_MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, not {max_points}")
        self.max_points = max_points
        self.every = 1  # keep one offered point of this many
        self._offered = 0
        self._points: list[SeriesPoint] = []

    def add(self, point: SeriesPoint) -> None:
        offered, self._offered = self._offered, self._offered + 1
        if offered % self.every:
            return
        self._points.append(point)
        if len(self._points) >= self.max_points:
            # Points kept are offered indices 0, every, 2*every...: keeping the even ones
            # leaves 0, 2*every...: the same rule with the interval doubled.
            del self._points[1::2]
            self.every *= 2

    @property
    def points(self) -> tuple[SeriesPoint, ...]:
        return tuple(self._points)


@dataclass(frozen=True, slots=True)
class Sampled:
    """What a launch's sampling found."""

    reader: str | None
    peaks_mib: dict[str, int] = field(default_factory=dict)  # phase -> worst device's peak
    samples: int = 0
    failure: str | None = None  # "sampler failed: ..."
    total_mib: int | None = None  # the smallest device's total, as the reader reports it
    series: tuple[SeriesPoint, ...] = ()  # bounded: at most SERIES_MAX_POINTS, oldest first
    last_mib: dict[str, int] = field(default_factory=dict)  # phase -> its last worst-device sample
    # On a Ray cluster (`pretuner.cluster.sampling`): node label -> its worst device's peak
    node_peaks_mib: dict[str, int] = field(default_factory=dict)

    @property
    def peak_mib(self) -> int | None:
        return max(self.peaks_mib.values(), default=None)


class MemorySampler:
    """Sample `reader` (None: nothing) on a thread, each sample tagged with the phase."""

    def __init__(self, reader: DeviceReader | None, first_phase: str = "launch",
                 status: Phase | None = None, series_max_points: int = SERIES_MAX_POINTS) -> None:
        self.reader = reader
        self.status = status  # told the memory seen so far, every STATUS_EVERY_S
        self.interval_s = max(FASTEST_INTERVAL_S, reader.interval_s if reader else 0.0)
        self._phase = first_phase
        self._peaks: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._samples = 0
        self._failure: str | None = None
        self._total: int | None = None
        self._series = BoundedSeries(series_max_points)
        self._t0 = time.monotonic()  # the launch starts when its sampler is made
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wrap(self, phase: Phase) -> Phase:
        """`phase`, telling this sampler each new phase first."""
        if self.reader is None:
            return phase

        def tagged(name: str, detail: str) -> None:
            if name not in STATUS_EVENTS:
                self._phase = name  # one str assignment: atomic for the sampling thread
            phase(name, detail)

        return tagged

    def start(self) -> MemorySampler:
        if self.reader is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self.reader,),
                                            name="memory-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> Sampled:
        """Stop sampling (promptly: a read in flight is waited for at most STOP_WAIT_S)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
        return self.snapshot()

    def snapshot(self) -> Sampled:
        """What was sampled so far (sampling goes on)."""
        with self._lock:
            name = self.reader.name if self.reader is not None else None
            return Sampled(name, dict(self._peaks), self._samples, self._failure, self._total,
                           self._series.points, dict(self._last))

    def _run(self, reader: DeviceReader) -> None:
        told = 0.0
        how = " (simulated)" if reader.name == "emulated" else ""
        while not self._stop.is_set():
            t0 = time.monotonic()
            phase = self._phase
            try:
                sample = reader.sample()
            except Exception as err:  # any reader error: this launch is measured from its logs
                log.warning("device memory sampling (%s) stopped: %s", reader.name, err)
                with self._lock:
                    self._failure = f"sampler failed: {type(err).__name__}: {err}"
                return
            if sample is not None and sample.devices:  # (none: nothing to read this time)
                used = sample.worst_used_mib
                total = min(d.total_mib for d in sample.devices)
                point = SeriesPoint(round(t0 - self._t0, 3), phase,
                                    tuple((d.device, d.used_mib) for d in sample.devices))
                with self._lock:
                    self._samples += 1
                    self._series.add(point)
                    self._total = total if self._total is None else min(self._total, total)
                    if used > self._peaks.get(phase, -1):
                        self._peaks[phase] = used
                    self._last[phase] = used
                    peak = max(self._peaks.values())
                if self.status is not None and time.monotonic() - told >= STATUS_EVERY_S:
                    told = time.monotonic()
                    self.status("memory", f"{used:,} MiB used now, peak {peak:,} MiB this "
                                f"launch ({reader.name}{how})")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))


def series_tsv(sampled: Sampled, launch: int) -> str | None:
    """The launch's time series as `memory.tsv` (`devices.series`); None when it is empty."""
    if not sampled.series:
        return None
    total = "unknown" if sampled.total_mib is None else str(sampled.total_mib)
    lines = [
        f"# launch {launch}: device memory read by {sampled.reader}; total_mib={total}"
        " (the smallest device's); t_s: seconds since the launch started",
        HEADER,
    ]
    for p in sampled.series:
        lines += [f"{p.t_s:.3f}\t{p.phase}\t{dev}\t{used}" for dev, used in p.used_mib]
    return "\n".join(lines) + "\n"
