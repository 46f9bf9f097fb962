"""Shared helpers for tests that run the CLI (in-process or as the real console script) and
inspect processes."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest

# The emulated V1 card's clock runs 100x fast: a test measures relative speeds, not seconds.
# Its engine's default max-num-seqs is 64, not vLLM's 1,024 on a large card: a 1,024-wide
# burst costs about 4.5 CPU seconds a launch here. The tests of the default width and of a
# too-wide burst set it back (WIDE_DEFAULT).
FAST_SIM = {"PRETUNER_SIM_STARTUP_S": "0.2", "PRETUNER_SIM_TEARDOWN_S": "0.1",
            "PRETUNER_SIM_TIME_SCALE": "0.01", "PRETUNER_SIM_MAX_NUM_SEQS": "64"}
WIDE_DEFAULT = {"PRETUNER_SIM_MAX_NUM_SEQS": ""}  # vLLM's own rule for the emulated card


# Canonical emulated runs, `pretuner run ARGS`: built once per session by tests/conftest.py
# `finished_run` and read by the tests of several files (one that writes in it takes a copy,
# shutil.copytree(..., symlinks=True)).
R01_QWEN_64 = ("--model", "qwen3-8b", "--card", "64", "--json")
R01_QWEN_32_CHUNKED = ("--model", "qwen3-8b", "--card", "32", "--tp", "1",
                       "--max-model-len", "40960", "--json")  # fmt: skip
# Measured, on an idle card: one sequence of 40,960 tokens does not fit qwen3-8b at TP1 on
# 24 GiB, and the minimum length is that one (exit 4, a failure report).
R01_INFEASIBLE = ("--model", "qwen3-8b", "--card", "24", "--tp", "1", "--max-model-len", "40960",
                  "--min-model-len", "40960")  # fmt: skip
V1_QWEN_80_32K = ("--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                  "--max-model-len", "32768", "--json")  # fmt: skip
# Issue 29's run: at the engine's own default width (1024 on the H100), not the tests' 64.
WIDE_RUNS = {V1_QWEN_80_32K}
# Without --json: a test reads the text summary it prints.
V1_QWEN_80_8K = ("--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                 "--max-model-len", "8192")  # fmt: skip


@dataclass(frozen=True)
class FinishedRun:
    """`pretuner run ARGS --out folder` as it ended: its folder, exit code, stdout and stderr."""

    folder: Path
    proc: subprocess.CompletedProcess[str]

    def report(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.folder / "report.json").read_text())
        return data


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRETUNER_SIM_")}
    env.update(FAST_SIM)
    # Each call its own emulated card: servers of concurrent test runs must not share one.
    if "PRETUNER_SIM_STATE_DIR" not in extra:
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


# The signals a command may take over (pretuner.launch.process, pretuner.stopflag).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def invoke(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`run_cli` without the subprocess: the console script's own `main()` (global flags hoisted,
    the one error boundary, its exit codes and `--json` errors) called in this process under
    typer's CliRunner isolation: stdin empty, stdout and stderr captured apart (help wrapped as
    in a pipe), os.environ exactly `env` (cli_env() when None), the current folder `cwd`.

    What a fresh interpreter would have, each call gets and gives back: no logging handler on
    the root logger (pytest's, and the one `basicConfig` adds on the captured stderr, which
    closes), `--debug` off, the signal handlers, the folder. A command that crashes raises here.
    Only for commands that start no server (a server started from here would share this
    process's signals and session): a launch fails the test, which then uses `run_cli`.
    """
    from typer import testing  # its CliRunner
    from typer._click import formatting  # typer's own (vendored) click, whose width it forces

    from pretuner.cli.app import main, state  # `pretuner.cli.app` the attribute is the Typer
    from pretuner.launch.process import ServerProcess

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("invoke() runs commands that start no server: use run_cli")

    with tempfile.TemporaryDirectory(prefix="pretuner-card-") as card:
        environ = env if env is not None else cli_env(PRETUNER_SIM_STATE_DIR=card)
        patch: dict[str, str | None] = {k: None for k in os.environ if k not in environ}
        patch.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        signals = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        folder = Path.cwd()
        code: int | str | None = 0
        with (testing.CliRunner().isolation(env=patch) as (out, err, _),
              # help wrapped as for a process whose stdout is a pipe: $COLUMNS, else 80 wide
              mock.patch.object(formatting, "FORCED_WIDTH", None),
              mock.patch("os.get_terminal_size", side_effect=OSError("not a terminal")),
              mock.patch.object(ServerProcess, "start", no_launch)):
            root.handlers = []
            state.debug = False
            try:
                if cwd is not None:
                    os.chdir(cwd)
                main(list(args))
            except SystemExit as exc:
                code = exc.code
            finally:
                os.chdir(folder)
                for handler in root.handlers:
                    handler.close()
                root.handlers, root.level = handlers, level
                state.debug = False
                for sig, previous in signals.items():
                    if previous is not None:  # None: not set from Python, nothing to give back
                        signal.signal(sig, previous)
                sys.stdout.flush()
                sys.stderr.flush()
                stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): Python prints it, exit status 1
        stderr, code = f"{stderr}{code}\n", 1
    return subprocess.CompletedProcess(["pretuner", *args], code, stdout, stderr)


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


def wait_for(path: Path, text: str, timeout: float = 60) -> None:
    """Until `text` appears in the file at `path` (a log, a captured stderr)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def first_launch_line(dry_run_text: str) -> str:
    """The command line in `pretuner run --dry-run`'s text (env and argv, secrets redacted)."""
    lines = dry_run_text.splitlines()
    return lines[lines.index("launch 1 (pre-run) would be:") + 1]


def default_sigint() -> None:
    """preexec_fn for a child a test interrupts with SIGINT: a shell's background job starts
    its children with SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# `../shared` beside the checkout (CI puts it there): the real logs of real engines.
SHARED = Path(__file__).resolve().parents[2] / "shared"
# Copies of real HF config.json files (from ../shared/model-configs): tests read them here.
CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"


def shared(*parts: str) -> Path:
    """A path under `../shared`; a test (or a module's collection) that needs it fails with
    this message when it is missing, never skips: CI always clones the project beside it."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"{path} is missing: these tests read the real engine logs in ../shared, "
                    "which must sit beside the checkout (CI clones it there)", pytrace=False)
    return path




def require(module: str, env_var: str) -> ModuleType:
    """Import a real engine's module for a test; without it the test skips, unless `env_var` is
    1 (CI sets it): then it fails, so a broken install never passes as a skip."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if os.environ.get(env_var) == "1":
            pytest.fail(f"{env_var}=1 but {module} does not import ({err}); install the extra "
                        "(pip install -e '.[dev,mindspore,ray]')", pytrace=False)
        pytest.skip(f"{module} is not installed (with {env_var}=1 this is a failure)",
                    allow_module_level=True)


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
