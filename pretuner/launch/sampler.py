"""Device memory sampled in the background during a launch: the peak of each phase.

Only per-phase peaks are kept (bounded memory however long the launch). A reader that fails
is logged once and sampling stops; the launch goes on, measured from its logs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pretuner.devices.base import FASTEST_INTERVAL_S, DeviceReader

log = logging.getLogger(__name__)

STOP_WAIT_S = 0.4  # how long stop() waits for a sample in flight (a slow command)

Phase = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class Sampled:
    """What a launch's sampling found."""

    reader: str | None
    peaks_mib: dict[str, int] = field(default_factory=dict)  # phase -> worst device's peak
    samples: int = 0
    failure: str | None = None  # "sampler failed: ..."
    total_mib: int | None = None  # the smallest device's total, as the reader reports it

    @property
    def peak_mib(self) -> int | None:
        return max(self.peaks_mib.values(), default=None)


class MemorySampler:
    """Sample `reader` every `interval_s` (at most every 20 ms) on a daemon thread, tagging
    each sample with the phase last reported through `wrap`. A None reader samples nothing."""

    def __init__(self, reader: DeviceReader | None, first_phase: str = "launch") -> None:
        self.reader = reader
        self.interval_s = max(FASTEST_INTERVAL_S, reader.interval_s if reader else 0.0)
        self._phase = first_phase
        self._peaks: dict[str, int] = {}
        self._samples = 0
        self._failure: str | None = None
        self._total: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wrap(self, phase: Phase) -> Phase:
        """`phase`, telling this sampler each new phase first."""
        if self.reader is None:
            return phase

        def tagged(name: str, detail: str) -> None:
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
        with self._lock:
            name = self.reader.name if self.reader is not None else None
            return Sampled(name, dict(self._peaks), self._samples, self._failure, self._total)

    def _run(self, reader: DeviceReader) -> None:
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
            if sample is not None:
                used = sample.worst_used_mib
                total = min(d.total_mib for d in sample.devices)
                with self._lock:
                    self._samples += 1
                    self._total = total if self._total is None else min(self._total, total)
                    if used > self._peaks.get(phase, -1):
                        self._peaks[phase] = used
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))
