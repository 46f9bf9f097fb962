"""MindSpore's memory-pool dump, complete or cut short, parsed from one line of text.

A dump is printed at teardown (and on an OOM) as per-pool header lines (best-fit pool:
`Common mem pool info: ...`, `Persistent mem pool info: ...`) and then one summary line
(`The dynamic memory pool ... actual peak used mem:NM ...`). A rank killed while writing it, or
whose buffered log was never flushed, leaves the headers without the summary, or a summary
line that stops before its `actual peak used` figure: `PoolDumpHeader` and `PartialPoolDump`
let the summary say so instead of dropping that rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

SUMMARY_START = "The dynamic memory pool"
HEADER_TEXT = " mem pool info: "  # `Common mem pool info: `, `Persistent mem pool info: `


class PoolFormat(str, Enum):
    """Which MindSpore memory-pool dump a `PoolDump` came from."""

    STAT_JSON = "stat_json"  # 2.4-2.5: `The dynamic memory pool stat info : {...}`
    NAMED_POOL = "named_pool"  # 2.6+: `The dynamic memory pool[Name] stat info : {...}`
    BEST_FIT = "best_fit"  # `The dynamic memory pool total allocated mem:...`
    ALLOC_DETAIL = "alloc_detail"  # GLOG_v=0 per-allocation lines, figures in bytes


@dataclass(frozen=True, slots=True)
class PoolDump:
    """A MindSpore memory-pool dump; `actual_peak_mib` includes the KV cache."""

    actual_peak_mib: int
    peak_used_mib: float | None
    in_use_mib: float | None
    alloc_mib: float | None
    idle_mib: float | None
    other_mib: float | None
    pool_name: str | None
    format: PoolFormat
    profiled: bool  # printed to stdout with the [MS_RUNTIME_PROF] tag


@dataclass(frozen=True, slots=True)
class PartialPoolDump:
    """A summary line cut before its `actual peak used` figure: that peak is unknown."""

    format: PoolFormat
    pool_name: str | None
    peak_used_mib: float | None  # `peak used mem` if printed before the cut: the peak is more
    profiled: bool


@dataclass(frozen=True, slots=True)
class PoolDumpHeader:
    """A per-pool line that opens a best-fit dump (`Common mem pool info: ...`)."""

    pool: str  # "Common", "Persistent"
    profiled: bool


MAX_FIGURE_MIB = 2.0**50  # a pool figure above this many MiB (a zettabyte) is garbage
_NUM = r"-?\d+(?:\.\d+)?"
# A "key: number+unit" pair of the pool dumps: JSON keys are quoted, the rest are not.
_POOL_PAIR = re.compile(r'"?([A-Za-z][A-Za-z ]{0,60}?)"?\s?:\s?(' + _NUM + r")(MB|M|B)(?![A-Za-z])")
_POOL_KEYS: tuple[tuple[str, str], ...] = (
    ("actual peak used mem", "actual_peak"),
    ("peak used mem", "peak_used"),
    ("in used mem", "in_use"),
    ("total allocated mem", "alloc"),
    ("alloc mem", "alloc"),
    ("idle mem", "idle"),
    ("other used size", "other"),
)
_POOL_NAME = re.compile(r"memory pool\[([^\]]{1,80})\]")
_HEADER = re.compile(r"(\w{1,40}) mem pool info: ")
# DumpDynamicMemPoolDebugInfo's line: the stat JSON alone, no peak, by design not a cut dump.
_DEBUG_STAT = re.compile(r"stat info : \{[^{}]*\}\s*$")
# How the summary line goes on after SUMMARY_START. Other lines begin the same way and never
# carry a peak (`The dynamic memory pool total size is ...`, at compile time and in 1.x).
_SUMMARY_NEXT = (" total allocated mem:", " stat info : ", "[")
_UNIT_MIB = {"B": 1.0 / 2**20, "M": 1.0, "MB": 1.0}


def parse_pool_dump(text: str) -> PoolDump | PartialPoolDump | None:
    """The pool dump in a line, a `PartialPoolDump` when its summary is cut, or None."""
    start = text.find(SUMMARY_START)
    if start < 0:
        start = text.find("memory details")
        if start < 0:
            return None
    figures: dict[str, float] = {}
    for match in _POOL_PAIR.finditer(text, start):
        key = match.group(1).strip().lower()
        for suffix, field in _POOL_KEYS:
            if key.endswith(suffix):
                if field not in figures:
                    figures[field] = float(match.group(2)) * _UNIT_MIB[match.group(3)]
                break
    name = _POOL_NAME.search(text, start)
    if "memory details" in text[start : start + 16]:
        fmt = PoolFormat.ALLOC_DETAIL
    elif name:
        fmt = PoolFormat.NAMED_POOL
    elif "stat info" in text:
        fmt = PoolFormat.STAT_JSON
    else:
        fmt = PoolFormat.BEST_FIT
    profiled = "[MS_RUNTIME_PROF]" in text[: start + 1]
    if not all(math.isfinite(x) and abs(x) < MAX_FIGURE_MIB for x in figures.values()):
        return None  # a figure of hundreds of digits is garbage, not a measurement
    if "actual_peak" not in figures:
        if fmt is PoolFormat.ALLOC_DETAIL or not _is_summary(text, start):
            return None
        return PartialPoolDump(
            format=fmt,
            pool_name=name.group(1) if name else None,
            peak_used_mib=figures.get("peak_used"),
            profiled=profiled,
        )
    return PoolDump(
        actual_peak_mib=math.ceil(figures["actual_peak"]),
        peak_used_mib=figures.get("peak_used"),
        in_use_mib=figures.get("in_use"),
        alloc_mib=figures.get("alloc"),
        idle_mib=figures.get("idle"),
        other_mib=figures.get("other"),
        pool_name=name.group(1) if name else None,
        format=fmt,
        profiled=profiled,
    )


def _is_summary(text: str, start: int) -> bool:
    """Whether a line without a peak is a dump's summary line (one cut short)."""
    rest = text[start + len(SUMMARY_START) : start + len(SUMMARY_START) + 24].rstrip("\r\n")
    if not any(rest.startswith(n) or n.startswith(rest) for n in _SUMMARY_NEXT):
        return False
    return _DEBUG_STAT.search(text, start) is None


def parse_pool_header(text: str) -> PoolDumpHeader | None:
    """The per-pool line that opens a best-fit dump, or None."""
    found = _HEADER.search(text)
    if found is None:
        return None
    return PoolDumpHeader(found.group(1), "[MS_RUNTIME_PROF]" in text[: found.start() + 1])
