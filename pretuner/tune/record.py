"""The run record: one folder per run, a journal that `--resume` replays, and the result files.

Layout of a run folder:
  journal.jsonl            one JSON object per event (run start, launch, decision, result)
  launch-<n>/command.json  the exact argv and environment (secrets redacted)
  launch-<n>/server.log    everything the server printed (one fresh log per attempt: an
                           interrupted attempt's folder is moved to launch-<n>.interrupted-<k>)
  launch-<n>/server.pid    the server's pid and process group while it runs
  launch-<n>/scan.json     what the log scanner found
  report.md, report.json   the result, or why the run failed (a PretunerError)
  tuned.env, serve.sh      the tuned configuration (finished runs only)
  .lock                    flock'ed by the pretuner process running the run (its pid inside)
"""

from __future__ import annotations

import json
import logging
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
from pretuner.redact import redact_options, restore_command_text
from pretuner.tune.ownership import (
    RunLock,
    check_free_space,
    disk_full_error,
    is_disk_full,
    lock_folder,
)

JOURNAL = "journal.jsonl"


def check_folder_name(path: str, option: str) -> None:
    """Refuse a run folder whose path holds a newline or another control character: its name is
    the run id that report.md and serve.sh print, and pretuner never needs one."""
    if not path.isprintable():
        raise BadInputError(
            f"{option} {path!r} contains a newline or another control character",
            hint="choose a folder name of printable characters",
        )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "model"


@dataclass
class RunRecord:
    """A run folder, created exclusively so that no earlier run is ever overwritten."""

    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: RunLock | None = field(default=None, repr=False)  # held for the whole run

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
            return cls(path=candidate, lock=lock_folder(candidate))
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
        events = read_journal(journal)
        for started in (e for e in events if e.get("event") == "run_started"):
            options = started.get("options")
            if isinstance(options, dict) and isinstance(options.get("serve_cmd"), str):
                # The journal keeps no secret: each comes back from its variable (as serve.sh's).
                options["serve_cmd"] = restore_command_text(
                    options["serve_cmd"], os.environ, Path(path).name
                )
        return cls(path=Path(path), events=events)

    def append(self, event: str, **data: Any) -> dict[str, Any]:
        """Append one event to the journal and fsync it: it survives a crash right after."""
        if "options" in data:  # run_started: `--serve-cmd ... --api-key K` is kept redacted
            data["options"] = redact_options(data["options"])
        entry = {"event": event, "time": time.time(), **data}
        try:
            with open(self.path / JOURNAL, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as err:
            if is_disk_full(err):
                raise disk_full_error(err, self.path) from None
            raise
        self.events.append(entry)
        return entry

    def of_kind(self, event: str) -> Iterator[dict[str, Any]]:
        return (e for e in self.events if e["event"] == event)

    def launch_dir(self, n: int) -> Path:
        """A fresh folder for launch `n`, after checking the disk has room for it."""
        check_free_space(self.path)
        folder = self.path / f"launch-{n}"
        if folder.exists():
            # Moved aside, not reused: a server orphaned by a killed pretuner may still write its
            # pool dump to its old log, which the scan must not read as a rank of this attempt.
            k = 1
            while (aside := self.path / f"launch-{n}.interrupted-{k}").exists():
                k += 1
            folder.rename(aside)
        folder.mkdir()
        return folder

    def write(self, name: str, text: str, *, executable: bool = False) -> Path:
        return write_atomic(self.path / name, text, executable=executable, overwrite=True)

    def write_json(self, name: str, data: Any) -> Path:
        return self.write(name, json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_journal(journal: Path) -> list[dict[str, Any]]:
    """The journal's events; a line cut by a crash is skipped, anything else wrong is refused."""
    try:
        text = journal.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        raise BadInputError(
            f"cannot read {str(journal)!r}: {err.strerror}", hint="check the run folder"
        ) from None
    events: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            # A line cut by a crash (SIGKILL mid-write); the lines after it were appended by
            # a resume and stand.
            logging.getLogger(__name__).warning("%s:%d is not JSON: skipped", journal, n)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("event"), str):
            raise BadInputError(
                f"{str(journal)!r} line {n} is not a journal event (a JSON object with an "
                f"'event'): {line[:80]!r}",
                hint="the journal is damaged or not pretuner's: start a new run",
            )
        events.append(entry)
    return events
