"""Shared helpers for tests that run the real console script and inspect processes."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

# The emulated V1 card's clock runs 100x fast: a test measures relative speeds, not seconds.
FAST_SIM = {"PRETUNER_SIM_STARTUP_S": "0.2", "PRETUNER_SIM_TEARDOWN_S": "0.1",
            "PRETUNER_SIM_TIME_SCALE": "0.01"}


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRETUNER_SIM_")}
    env.update(FAST_SIM)
    # Each call its own emulated card: servers of concurrent test runs must not share one.
    env["PRETUNER_SIM_STATE_DIR"] = tempfile.mkdtemp(prefix="pretuner-card-")
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pretuner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else cli_env(),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def processes_holding(path: Path) -> list[int]:
    """Pids of processes that have `path` open (a server still writing its log)."""
    target = str(path.resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    if os.readlink(fd) == target:
                        pids.append(int(entry.name))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return pids


def default_sigint() -> None:
    """preexec_fn for a child a test interrupts with SIGINT: a shell's background job starts
    its children with SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# `../shared` beside the checkout (CI puts it there): real logs, model configs, seeds.
SHARED = Path(__file__).resolve().parents[2] / "shared"
REAL_LOGS = SHARED / "real-logs"


def load_script(name: str) -> ModuleType:
    """A script of scripts/ (`bench_vl`), imported as a module for its tests."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
