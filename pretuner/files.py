"""Atomic, never-overwriting file writes: a crash never leaves half a file, nothing a user
made is replaced, and no secret is written (pretuner.redact.redact_text); and bounded reads
of the files a user hands in."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from pretuner.errors import BadInputError
from pretuner.redact import redact_text


def write_atomic(path: Path, text: str, *, executable: bool = False,
                 overwrite: bool = False) -> Path:
    """Write `text` to `path` via a temp file in the same folder, fsync, then link or replace;
    without `overwrite`, an existing file is an error."""
    path, text = Path(path), redact_text(text)
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


# A `vllm serve --config` YAML or a model's config.json is a few kilobytes; more is a mistake
# (`--config /dev/zero` once took 22 GB before the kernel ended it).
MAX_INPUT_BYTES = 1 << 20
# Values and nesting after expansion: a YAML alias repeats what it names, so nine nested
# aliases of nine make 9^9 values out of one kilobyte. No config comes near either bound.
MAX_INPUT_VALUES = 100_000
MAX_INPUT_DEPTH = 32


def read_bounded(path: Path, limit: int = MAX_INPUT_BYTES) -> bytes:
    """A user's input file, whole; a FIFO, a device or a file over `limit` bytes is refused
    before it is read (a FIFO is opened without waiting for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise BadInputError(f"{str(path)!r} is not a regular file",
                                    hint="pass the file itself, not a device, pipe or folder")
            data = fh.read(limit + 1)
    except OSError as err:
        raise BadInputError(f"cannot read {str(path)!r}: {err.strerror}") from None
    if len(data) > limit:
        raise BadInputError(f"{str(path)!r} is over {limit >> 10:,} KiB",
                            hint="no such file is that large: is it the right one?")
    return data


def check_expanded(data: Any, path: Path) -> None:
    """Refuse parsed input that expands past `MAX_INPUT_VALUES` values or nests deeper than
    `MAX_INPUT_DEPTH` (counted as walked, so a shared or self-referencing value costs each
    time it is reached, and the walk ends at the bound)."""
    stack, count = [(data, 0)], 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_INPUT_VALUES or depth > MAX_INPUT_DEPTH:
            what = (f"more than {MAX_INPUT_VALUES:,} values" if count > MAX_INPUT_VALUES
                    else f"nesting deeper than {MAX_INPUT_DEPTH}")
            raise BadInputError(f"{str(path)!r} expands to {what} (aliases or nesting)",
                                hint="write the values out plainly")
        if isinstance(item, dict):
            stack += [(part, depth + 1) for pair in item.items() for part in pair]
        elif isinstance(item, list):
            stack += [(part, depth + 1) for part in item]

def scrub(path: Path) -> bool:
    """Rewrite a file pretuner's server wrote (its log) with every secret redacted, a MiB of
    lines at a time and atomically; untouched when it holds none. Whether it was rewritten."""
    def batches(src: TextIO) -> Iterator[str]:
        while lines := src.readlines(1 << 20):
            yield "".join(lines)

    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as src:
        if all(redact_text(text) == text for text in batches(src)):
            return False
        src.seek(0)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape", newline="") as out:
                out.writelines(redact_text(text) for text in batches(src))
            os.chmod(tmp, os.stat(path).st_mode & 0o777)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return True
