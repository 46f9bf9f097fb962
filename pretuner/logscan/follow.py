"""Live mode: follow a log that is still being written and report events as they appear."""

from __future__ import annotations

import os
from pathlib import Path

from pretuner.logscan.events import Located, LogEvent
from pretuner.logscan.files import rank_from_path
from pretuner.logscan.lines import locate_line
from pretuner.logscan.search import MAX_HIT_LINE_BYTES, find_anchor_lines, hit_bytes

READ_BYTES = 4 * 2**20  # at most this much is read per poll: memory stays bounded
MAX_PENDING_BYTES = 2**20  # a partial line longer than this is dropped (kept: its head)


class LogFollower:
    """Tail one log file: each `poll()` reads only the bytes added since the last one.

    Tolerates a file that does not exist yet, a last line still being written (kept until its
    newline arrives), and a file replaced or truncated under it (read again from the start).
    With `keep`, only events of those types are returned: a final poll over a pool dump of
    thousands of lines then holds none of them.
    """

    def __init__(self, path: Path | str, *, keep: tuple[type[LogEvent], ...] | None = None) -> None:
        self.path = str(path)
        self.keep = keep
        self.rank = rank_from_path(self.path)
        self.offset = 0
        self.line = 0  # complete lines consumed so far
        self._pending = b""
        self._identity: tuple[int, int] | None = None

    def poll(self, *, final: bool = False) -> list[Located]:
        """Events in the lines completed since the last call (and the partial one if final)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return []
        identity = (info.st_dev, info.st_ino)
        if self._identity != identity or info.st_size < self.offset:
            self._identity = identity
            self.offset = 0
            self.line = 0
            self._pending = b""
        events: list[Located] = []
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                while True:
                    data = handle.read(READ_BYTES)
                    if not data:
                        break
                    self.offset += len(data)
                    events.extend(self._feed(data))
        except OSError:
            return events
        if final and self._pending:
            events.extend(self._lines(self._pending))
            self._pending = b""
        return events

    def _feed(self, data: bytes) -> list[Located]:
        chunk = self._pending + data
        cut = chunk.rfind(b"\n") + 1
        self._pending = chunk[cut:]
        if len(self._pending) > MAX_PENDING_BYTES:
            self._pending = self._pending[:MAX_HIT_LINE_BYTES]
        return self._lines(chunk[:cut])

    def _lines(self, text: bytes) -> list[Located]:
        """The events of `text`'s lines, found as the scanner finds them (`search`)."""
        hits, newlines = find_anchor_lines(text, 0, len(text))
        events: list[Located] = []
        for start, end, at, before in hits:
            raw = hit_bytes(text, start, end, at)
            found = locate_line(raw, self.path, self.line + before + 1, self.rank)
            events += [ev for ev in found if self.keep is None or isinstance(ev.event, self.keep)]
        self.line += newlines
        return events
