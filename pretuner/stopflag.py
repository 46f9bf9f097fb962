"""A stop request that a signal handler may set: the servers' SIGINT/SIGTERM flag.

A `threading.Event` cannot be set from a signal handler safely: the handler runs in the main
thread between two bytecodes, and when the main thread is inside `Event.wait` at that moment it
holds the event's lock, so `Event.set` in the handler waits for itself forever (seen in CI: an
emulated server that ignored SIGTERM until it was killed 120 s later). This flag takes no lock:
setting it is one attribute store, and waiting polls it.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

POLL_S = 0.02


class StopFlag:
    """Set once by a signal (or any thread), read without locks."""

    def __init__(self) -> None:
        self._set = False
        self.signal_name = ""

    def install(self, *signums: signal.Signals) -> None:
        """Make these signals (SIGINT and SIGTERM when none are named) set the flag."""
        for signum in signums or (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        self._set = True

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the flag is set or `timeout` seconds pass; True when it is set."""
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(POLL_S, left))
        return True
