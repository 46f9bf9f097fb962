"""Log scanning: find every memory line of MindSpore, vLLM and vllm-ascend in any log.

`lines` parses one line (into the types of `events`), `search` and `scanner` find candidate
lines fast and stream their events, `summary` aggregates them per rank in bounded memory into a
`result.ScanResult` (and folds a V1 engine's facts, `v1`), `follow` tails a log that is still
being written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pretuner.errors import BadInputError
from pretuner.logscan.files import list_log_files
from pretuner.logscan.follow import LogFollower
from pretuner.logscan.result import RankSummary, ScanResult
from pretuner.logscan.scanner import iter_scan
from pretuner.logscan.summary import summarize_items


def scan_paths(paths: Sequence[Path], *, workers: int | None = None) -> ScanResult:
    """Scan log files and folders (recursively, `.gz` included) and summarise per rank."""
    for path in paths:
        if not Path(path).exists() and not Path(path).is_symlink():
            raise BadInputError(
                f"log path {str(path)!r} does not exist", hint="pass a log file or a folder"
            )
    files, unreadable = list_log_files(paths)
    return summarize_items(iter_scan(files, workers=workers), unreadable)


__all__ = ["LogFollower", "RankSummary", "ScanResult", "scan_paths"]
