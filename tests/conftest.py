"""Canonical emulated runs, shared: each `pretuner run ARGS` that tests of several files only
read (report.md/json/html, serve.sh, the journal, `script RUN`, `presets add RUN`) is run once
per session, whatever the number of xdist workers, and read where it was written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers import WIDE_DEFAULT, WIDE_RUNS, FinishedRun, cli_env, run_cli


def _build(args: tuple[str, ...], where: Path) -> FinishedRun:
    """The run of `args` under `where`, run now unless an earlier build left its result."""
    result = where / "result.json"
    if not result.is_file():
        if where.exists():  # a build that died half way: start again
            shutil.rmtree(where)
        where.mkdir(parents=True)
        env = cli_env(**(WIDE_DEFAULT if args in WIDE_RUNS else {}))
        proc = run_cli("run", *args, "--out", str(where / "run"), env=env)
        tmp = where / "result.json.tmp"
        tmp.write_text(json.dumps({"args": list(args), "returncode": proc.returncode,
                                   "stdout": proc.stdout, "stderr": proc.stderr}))
        os.replace(tmp, result)
    data = json.loads(result.read_text())
    proc = subprocess.CompletedProcess(["pretuner", "run", *args], data["returncode"],
                                       data["stdout"], data["stderr"])
    return FinishedRun(where / "run", proc)


@pytest.fixture(scope="session")
def finished_run(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> Callable[..., FinishedRun]:
    """`finished_run(*ARGS)`: the canonical run of `pretuner run ARGS`, built on first use.

    Under xdist each worker has its own session: the first to ask builds the run in the
    session's temporary folder, which all workers share, under a lock; the others wait for it
    and read it (the recipe of pytest-xdist's docs). A test reads it and never writes in it.
    """
    # Without workers getbasetemp().parent is shared by earlier sessions: keep to this one.
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "finished-runs"
    cache: dict[tuple[str, ...], FinishedRun] = {}

    def get(*args: str) -> FinishedRun:
        if args not in cache:
            key = hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
            root.mkdir(exist_ok=True)
            with FileLock(str(root / f"{key}.lock")):
                cache[args] = _build(args, root / key)
        return cache[args]

    return get


def _cost(item: pytest.Item) -> int:
    """0: a real engine (minutes), 1: processes and emulated runs (seconds), 2: in-process."""
    if item.get_closest_marker("engine"):
        return 0
    return 1 if item.get_closest_marker("slow") else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first, so that the xdist workers end together: under
    `--dist loadgroup --no-loadscope-reorder` the workers take tests in this order (a file's
    tests that share an expensive module fixture stay together by their `xdist_group`)."""
    items.sort(key=_cost)  # stable: file order within a tier
