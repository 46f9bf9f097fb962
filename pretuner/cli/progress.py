"""`pretuner run`'s progress on stderr, also under `--json` (stdout keeps the JSON alone).

One line per phase; between them the status keeps moving, so that a 20-minute wait for /health
or a long validation load is never silence: on a terminal a live line (rich) under the phase
lines, elsewhere a plain line (`status_line`) whenever nothing was said for `heartbeat_s`.
"""

from __future__ import annotations

import threading
import time
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from pretuner.launch.sampler import STATUS_EVENTS

HEARTBEAT_S = 15.0
TICK_S = 0.25


class Progress:
    """The run's `phase(name, detail)` callback, drawing on `stream`; `close()` when done."""

    def __init__(self, stream: IO[str], max_launches: int, *, live: bool | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.stream = stream
        self.max_launches = max_launches
        self.heartbeat_s = heartbeat_s
        self.t0 = time.monotonic()
        self.launch = 0
        self.phase = ""
        self.phase_t0 = self.t0
        self.status: dict[str, str] = {}
        self.said_at = self.t0
        self._lock = threading.Lock()
        self._done = threading.Event()
        is_tty = getattr(stream, "isatty", lambda: False)()
        self._live: Live | None = None
        if live if live is not None else is_tty:
            console = Console(file=stream, force_terminal=True, highlight=False)
            self._live = Live(self._status_text(), console=console, transient=True,
                              auto_refresh=False)
            self._live.start()
        self._ticker = threading.Thread(target=self._tick, name="pretuner-progress", daemon=True)
        self._ticker.start()

    def __call__(self, phase: str, detail: str) -> None:
        with self._lock:
            if phase in STATUS_EVENTS:
                self.status[phase] = detail
                return
            now = time.monotonic()
            if phase in ("launch", "replay"):  # a replayed launch keeps its number on --resume
                self.launch += 1
                self.status.clear()
            self.phase, self.phase_t0 = phase, now
            tag = f"#{self.launch}" if self.launch else "  "
            self._say(f"[{now - self.t0:7.1f}s] {tag:>3} {phase:<7} {detail}")

    def close(self) -> None:
        self._done.set()
        self._ticker.join(timeout=1.0)
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    # -- drawing (under the lock) -------------------------------------------------------------
    def _say(self, line: str) -> None:
        self.said_at = time.monotonic()
        if self._live is not None:
            self._live.console.print(Text(line), soft_wrap=True)
            self._live.update(self._status_text(), refresh=True)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def status_line(self) -> str:
        """What is going on now: launch, phase and its time, requests, memory."""
        now = time.monotonic()
        parts = [f"[{now - self.t0:7.1f}s]"]
        if self.launch:
            parts.append(f"launch {self.launch} of at most {self.max_launches}:")
        if self.phase:
            parts.append(f"{self.phase} for {now - self.phase_t0:.0f} s")
        for name in ("requests", "memory"):
            if name in self.status:
                parts.append(f"| {name} {self.status[name]}")
        return " ".join(parts)

    def _status_text(self) -> Text:
        return Text(self.status_line(), style="dim", overflow="ellipsis", no_wrap=True)

    def _tick(self) -> None:
        while not self._done.wait(TICK_S):
            with self._lock:
                if self._live is not None:
                    self._live.update(self._status_text(), refresh=True)
                elif self.phase and time.monotonic() - self.said_at >= self.heartbeat_s:
                    self._say(self.status_line())
