"""Log scanning: find every memory line of MindSpore, vLLM and vllm-ascend in any log.

`lines` parses one line (into the types of `events`), `search` and `scanner` find candidate
lines fast and stream their events, `summary` aggregates them per rank in bounded memory into a
`result.ScanResult`, `follow` tails a log that is still being written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from pretuner.errors import BadInputError
from pretuner.logscan.files import list_log_files
from pretuner.logscan.follow import LogFollower
from pretuner.logscan.lines import Located, LogEvent, OomEvent, OomKind, parse_line, parse_origin
from pretuner.logscan.result import (
    OomPhase,
    OomRecord,
    RankSummary,
    ScanResult,
    TruncatedRecord,
    Truncation,
)
from pretuner.logscan.scanner import ScanItem, iter_scan
from pretuner.logscan.summary import summarize_items

T = TypeVar("T")


def scan_paths(paths: Sequence[Path], *, workers: int | None = None) -> ScanResult:
    """Scan log files and folders (recursively, `.gz` included) and summarise per rank."""
    return fold_scan(paths, None, lambda acc, _: acc, workers=workers)[0]


def fold_scan(paths: Sequence[Path], start: T, add: Callable[[T, LogEvent], T], *,
              workers: int | None = None) -> tuple[ScanResult, T]:
    """`scan_paths`, and every event folded into `start` in file order on the way (what a
    summary does not keep, like a V1 engine's facts)."""
    for path in paths:
        if not Path(path).exists() and not Path(path).is_symlink():
            raise BadInputError(
                f"log path {str(path)!r} does not exist", hint="pass a log file or a folder"
            )
    files, unreadable = list_log_files(paths)
    acc = start

    def folding(items: Iterable[ScanItem]) -> Iterator[ScanItem]:
        nonlocal acc
        for item in items:
            if isinstance(item, Located):
                acc = add(acc, item.event)
            yield item

    return summarize_items(folding(iter_scan(files, workers=workers)), unreadable), acc


__all__ = [
    "LogEvent",
    "LogFollower",
    "Located",
    "OomEvent",
    "OomKind",
    "OomPhase",
    "OomRecord",
    "RankSummary",
    "ScanResult",
    "TruncatedRecord",
    "Truncation",
    "fold_scan",
    "parse_line",
    "parse_origin",
    "scan_paths",
]
