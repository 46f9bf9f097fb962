"""The run record: one folder per run, a journal that `--resume` replays, and the result files.

Layout of a run folder:
  journal.jsonl            one JSON object per event (run start, launch, decision, result)
  launch-<n>/command.json  the exact argv and environment (secrets redacted)
  launch-<n>/server.log    everything the server printed
  launch-<n>/scan.json     what the log scanner found
  report.md, report.json   the result, or why the run failed (a PretunerError)
  tuned.env, serve.sh      the tuned configuration (finished runs only)
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pretuner.errors import BadInputError
from pretuner.files import write_atomic

JOURNAL = "journal.jsonl"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "model"


@dataclass
class RunRecord:
    """A run folder, created exclusively so that no earlier run is ever overwritten."""

    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def create(cls, base: Path, model: str, card_gib: int | None) -> RunRecord:
        base = Path(base)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BadInputError(
                f"cannot create the run folder {str(base)!r}: {err.strerror}",
                hint="choose a writable --out",
            ) from None
        if not os.access(base, os.W_OK | os.X_OK):
            raise BadInputError(
                f"run folder {str(base)!r} is not writable", hint="choose a writable --out"
            )
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        card = f"{card_gib}g" if card_gib else "auto"
        name = f"{_slug(model)}-{card}-{stamp}"
        for n in range(1000):
            candidate = base / (name if n == 0 else f"{name}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            except OSError as err:
                raise BadInputError(
                    f"cannot create {str(candidate)!r}: {err.strerror}",
                    hint="choose a writable --out",
                ) from None
            return cls(path=candidate)
        raise BadInputError(f"too many runs named {name!r} in {str(base)!r}")

    @classmethod
    def open(cls, path: Path) -> RunRecord:
        """An existing run folder, with its journal read back (for --resume)."""
        journal = Path(path) / JOURNAL
        if not journal.is_file():
            raise BadInputError(
                f"{str(path)!r} is not a pretuner run folder (no {JOURNAL})",
                hint="pass the folder `pretuner run` printed",
            )
        events = []
        for line in journal.read_text("utf-8").splitlines():
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything before it stands
        return cls(path=Path(path), events=events)

    def append(self, event: str, **data: Any) -> dict[str, Any]:
        """Append one event to the journal and fsync it: it survives a crash right after."""
        entry = {"event": event, "time": time.time(), **data}
        with open(self.path / JOURNAL, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.events.append(entry)
        return entry

    def of_kind(self, event: str) -> Iterator[dict[str, Any]]:
        return (e for e in self.events if e["event"] == event)

    def launch_dir(self, n: int) -> Path:
        folder = self.path / f"launch-{n}"
        folder.mkdir(exist_ok=True)
        return folder

    def write(self, name: str, text: str, *, executable: bool = False) -> Path:
        return write_atomic(self.path / name, text, executable=executable, overwrite=True)

    def write_json(self, name: str, data: Any) -> Path:
        return self.write(name, json.dumps(data, indent=2, sort_keys=False) + "\n")
