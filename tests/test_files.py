"""Atomic, never-overwriting writes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pretuner.errors import BadInputError
from pretuner.files import write_atomic


def test_writes_and_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "tuned.env"
    write_atomic(target, "A=1\n")
    assert target.read_text() == "A=1\n"
    with pytest.raises(BadInputError, match="already exists and pretuner never overwrites"):
        write_atomic(target, "A=2\n")
    assert target.read_text() == "A=1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.env"]  # no temp file left


def test_executable_bit(tmp_path: Path) -> None:
    target = write_atomic(tmp_path / "serve.sh", "#!/bin/sh\n", executable=True)
    assert os.stat(target).st_mode & stat.S_IXUSR


def test_missing_or_unwritable_folder(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="does not exist"):
        write_atomic(tmp_path / "nope" / "x", "")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(BadInputError, match="not writable"):
            write_atomic(locked / "x", "")
    finally:
        locked.chmod(0o700)
