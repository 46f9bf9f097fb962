"""Which files a scan reads: folders walked once each, and the rank a file belongs to."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pretuner.errors import BadInputError

_RANK_DIR = re.compile(r"^rank_(\d+)$")
_RANK_FILE = re.compile(r"(?:^|[._-])rank[_-]?(\d+)(?:[._-]|$)")


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A file, or part of one, that could not be read, and why."""

    file: str
    reason: str


def rank_from_path(path: str) -> int | None:
    """The rank a file belongs to: a `rank_<N>` folder (GLOG_log_dir with RANK_ID) or name."""
    parts = Path(path).parts
    for part in reversed(parts[:-1]):
        found = _RANK_DIR.match(part)
        if found:
            return int(found.group(1))
    found = _RANK_FILE.search(parts[-1]) if parts else None
    return int(found.group(1)) if found else None


# Suffixes of what sits beside logs but is never one: docs, records, scripts, data, pictures.
NOT_LOGS = frozenset({
    ".md", ".rst", ".html", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".py", ".sh", ".env",
    ".service", ".csv", ".tsv", ".png", ".jpg", ".svg", ".pdf", ".lock",
})  # fmt: skip
# A server's log folder (GLOG_log_dir, a run folder) holds tens of files: a walk past this many
# was given the wrong folder (`/`, a home), and would read for hours.
MAX_WALKED = 20_000


def list_log_files(paths: Sequence[Path]) -> tuple[list[str], list[Unreadable]]:
    """Every regular file under the given paths, once each, and those that cannot be read.

    Directories are walked recursively without following links; a symlink (like MindSpore's
    `mindspore.INFO` pointing to the newest log) is skipped when its target is already listed.
    In a walked directory, documents and records that are not logs (`NOT_LOGS`: README.md, a
    run's report.json, serve.sh...) are left out; a file named on its own is always read.
    """
    seen: set[tuple[int, int]] = set()
    files: list[str] = []
    unreadable: list[Unreadable] = []
    pending: list[str] = []
    links: list[str] = []
    for path in paths:
        text = str(path)
        if os.path.isdir(text):
            for root, dirs, names in os.walk(text):
                dirs.sort()
                for name in sorted(names):
                    if os.path.splitext(name)[1].lower() in NOT_LOGS:
                        continue
                    full = os.path.join(root, name)
                    if len(pending) + len(links) >= MAX_WALKED:
                        raise BadInputError(
                            f"{text!r} holds over {MAX_WALKED:,} files: not a log folder",
                            hint="pass the server's log file or its GLOG_log_dir folder")
                    (links if os.path.islink(full) else pending).append(full)
        else:
            pending.append(text)
    for full in pending + links:
        try:
            info = os.stat(full)
        except OSError as err:
            unreadable.append(Unreadable(full, f"cannot stat: {err.strerror or err}"))
            continue
        key = (info.st_dev, info.st_ino)
        if key in seen or not os.path.isfile(full):
            continue
        seen.add(key)
        files.append(full)
    return files, unreadable
