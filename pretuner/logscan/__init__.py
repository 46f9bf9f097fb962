"""Log scanning: find every memory line of MindSpore, vLLM and vllm-ascend in any log.

`lines` parses one line (into the types of `events`), `search` and `scanner` find candidate
lines fast and stream their events, `summary` aggregates them per rank in bounded memory into a
`result.ScanResult`, `follow` tails a log that is still being written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from pretuner.errors import BadInputError
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
from pretuner.logscan.scanner import ScanItem, Unreadable, iter_log_files, iter_scan
from pretuner.logscan.summary import summarize_items


def scan_paths(paths: Sequence[Path], *, workers: int | None = None,
               each: Callable[[LogEvent], object] | None = None) -> ScanResult:
    """Scan log files and folders (recursively, `.gz` included) and summarise per rank;
    `each` sees every event too, in file order (what a summary does not keep)."""
    for path in paths:
        if not Path(path).exists() and not Path(path).is_symlink():
            raise BadInputError(
                f"log path {str(path)!r} does not exist", hint="pass a log file or a folder"
            )
    files: list[str] = []
    unreadable: list[Unreadable] = []
    for file, problem in iter_log_files(paths):
        if problem is None:
            files.append(file)
        else:
            unreadable.append(Unreadable(file, problem))
    items = iter_scan(files, workers=workers)
    return summarize_items(items if each is None else _tapped(items, each), unreadable)


def _tapped(items: Iterable[ScanItem], each: Callable[[LogEvent], object]) -> Iterator[ScanItem]:
    for item in items:
        if isinstance(item, Located):
            each(item.event)
        yield item


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
    "parse_line",
    "parse_origin",
    "scan_paths",
]
