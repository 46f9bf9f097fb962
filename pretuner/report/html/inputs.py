"""What report.html is built from, read from a run folder: its record (report.json), the
journal's decisions and each launch's `memory.tsv`. The parsers are pure; `read_run` is the only
file access."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretuner.devices.series import LaunchMemory, MemoryRow, parse_memory_tsv
from pretuner.report.records import AnyReport, decision_text, read_report

__all__ = ["LaunchMemory", "MemoryRow", "RunFiles", "parse_memory_tsv", "read_run"]

_LAUNCH_DIR = re.compile(r"^launch-(\d+)$")  # not `launch-3.interrupted-1`: a dead attempt


@dataclass(frozen=True, slots=True)
class Decision:
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class RunFiles:
    """Everything the page shows, as read from the run folder."""

    folder: Path
    report: AnyReport
    decisions: tuple[Decision, ...]
    memory: tuple[LaunchMemory, ...]


def decisions_of(journal_lines: list[str], report: AnyReport) -> tuple[Decision, ...]:
    """The journal's decisions in order; the report's own list when the journal has none."""
    found: list[dict[str, Any]] = []
    for line in journal_lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(event, dict) and event.get("event") == "decision":
            found.append(event)
    return tuple(Decision(str(d.get("decision", "?")), decision_text(d))
                 for d in found or report.decisions)


def read_run(folder: Path) -> RunFiles:
    """Read a run folder (raises BadInputError when it has no readable report.json)."""
    folder = Path(folder)
    report = read_report(folder)
    try:
        journal = (folder / "journal.jsonl").read_text("utf-8").splitlines()
    except OSError:
        journal = []
    launches = sorted(
        (int(m.group(1)), d)
        for d in folder.iterdir()
        if d.is_dir() and (m := _LAUNCH_DIR.match(d.name)) is not None
    )
    memory = tuple(
        parse_memory_tsv(n, (d / "memory.tsv").read_text("utf-8"))
        for n, d in launches
        if (d / "memory.tsv").is_file()
    )
    return RunFiles(folder, report, decisions_of(journal, report), memory)
