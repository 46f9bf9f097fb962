"""A launch's `memory.tsv`, the device series pretuner's sampler writes (`launch.sampler.
series_tsv`): read back by report.html and by `analyze --memory-series`. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOTAL = re.compile(r"total_mib=(\d+)")
_READER = re.compile(r"read by (\S+);")
HEADER = "t_s\tphase\tdevice\tused_mib"


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """One device at one moment of a launch."""

    t_s: float
    phase: str
    device: int
    used_mib: int


@dataclass(frozen=True, slots=True)
class LaunchMemory:
    """A launch's memory.tsv."""

    n: int
    total_mib: int | None  # the smallest device's total, from the header comment
    reader: str | None
    rows: tuple[MemoryRow, ...]


def parse_memory_tsv(n: int, text: str) -> LaunchMemory:
    """A memory.tsv: `#` comments (one says `total_mib=N`), a header line, then
    `t_s phase device used_mib` rows; a malformed row is skipped, not fatal."""
    total: int | None = None
    reader: str | None = None
    rows: list[MemoryRow] = []
    for line in text.splitlines():
        if line.startswith("#"):
            if (m := _TOTAL.search(line)) is not None:
                total = int(m.group(1))
            if (r := _READER.search(line)) is not None:
                reader = r.group(1)
            continue
        cells = line.split("\t")
        if len(cells) != 4 or cells[0] == "t_s":
            continue
        try:
            rows.append(MemoryRow(float(cells[0]), cells[1], int(cells[2]), int(cells[3])))
        except ValueError:
            continue
    return LaunchMemory(n, total, reader, tuple(rows))
