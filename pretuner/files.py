"""Atomic, never-overwriting file writes: a crash never leaves half a file, and nothing a user
made is replaced."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from pretuner.errors import BadInputError


def write_atomic(path: Path, text: str, *, executable: bool = False,
                 overwrite: bool = False) -> Path:
    """Write `text` to `path` via a temp file in the same folder, fsync, then link or replace;
    without `overwrite`, an existing file is an error."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise BadInputError(f"folder {str(folder)!r} does not exist", hint="create it first")
    if not os.access(folder, os.W_OK):
        raise BadInputError(f"folder {str(folder)!r} is not writable", hint="choose another --out")
    if path.is_dir():
        raise BadInputError(f"{str(path)!r} is a folder", hint="name the file to write")
    if path.exists() and not overwrite:
        raise BadInputError(f"{str(path)!r} already exists and pretuner never overwrites a file",
                            hint="choose another path or move the old file away")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o755 if executable else 0o644)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails atomically if the name was taken meanwhile
            except FileExistsError:
                raise BadInputError(f"{str(path)!r} appeared while writing; it was left untouched",
                                    hint="choose another path") from None
            os.unlink(tmp)
        with contextlib.suppress(OSError):  # the folder's entry too
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path

