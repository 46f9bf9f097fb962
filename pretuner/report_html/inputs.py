"""What report.html is built from, read from a run folder: report.json, the journal's decisions
and each launch's `memory.tsv`. The parsers are pure; `read_run` is the only file access."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretuner.devices.series import LaunchMemory, MemoryRow, parse_memory_tsv
from pretuner.errors import BadInputError

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
    report: dict[str, Any]
    decisions: tuple[Decision, ...]
    memory: tuple[LaunchMemory, ...]


def decisions_of(journal_lines: list[str], report: dict[str, Any]) -> tuple[Decision, ...]:
    """The journal's decisions in order; the report's own list when the journal has none."""
    found: list[dict[str, Any]] = []
    for line in journal_lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(event, dict) and event.get("event") == "decision":
            found.append(event)
    if not found:
        found = [d for d in report.get("decisions") or [] if isinstance(d, dict)]
    return tuple(
        Decision(str(d.get("decision", "?")), str(d.get("reason") or d.get("detail") or ""))
        for d in found
    )


def read_run(folder: Path) -> RunFiles:
    """Read a run folder (raises BadInputError when it has no readable report.json)."""
    folder = Path(folder)
    path = folder / "report.json"
    try:
        report = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise BadInputError(
            f"cannot read {str(path)!r}: {err}",
            hint="pass a run folder that has a report.json (a run that got as far as a launch)",
        ) from None
    if not isinstance(report, dict):
        raise BadInputError(f"{str(path)!r} is not a JSON object", hint="pass a run folder")
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
