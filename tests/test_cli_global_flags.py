"""--debug and -v/--verbose work after the subcommand too, as users type them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pretuner.cli  # noqa: F401  (registers the commands)
from pretuner.cli.app import hoist_global_flags
from tests.helpers import run_cli


@pytest.mark.parametrize(("argv", "read_as"), [
    (["run", "--model", "x", "--debug"], ["--debug", "run", "--model", "x"]),
    (["plan", "-v", "--model", "x"], ["-v", "plan", "--model", "x"]),
    (["presets", "show", "x", "--debug"], ["--debug", "presets", "show", "x"]),
    (["run", "--model=x", "--verbose"], ["--verbose", "run", "--model=x"]),
    # An option's value, what follows `--`, and the emulated servers' argv stay as they are.
    (["run", "--server-arg", "-v", "--model", "x"], ["run", "--server-arg", "-v", "--model", "x"]),
    (["sim", "vllm", "serve", "--debug"], ["sim", "vllm", "serve", "--debug"]),
    (["--debug", "run"], ["--debug", "run"]),
    (["scan", "--", "-v"], ["scan", "--", "-v"]),
])  # fmt: skip
def test_global_flags_move_before_the_subcommand(argv: list[str], read_as: list[str]) -> None:
    assert hoist_global_flags(argv) == read_as


@pytest.mark.slow
def test_debug_after_the_subcommand_prints_the_traceback_and_keeps_the_code() -> None:
    proc = run_cli("plan", "--model", "no-such-model", "--card", "64", "--debug")
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("pretuner: error:")


@pytest.mark.slow
def test_the_cli_needs_no_package_beyond_the_core_dependencies() -> None:
    """A plain `pip install pretuner` has no `click` (typer carries its own) and no `ray`: the
    CLI must start and plan without them (the dev extras here would hide it)."""
    code = ("import sys\n"
            "for name in ('click', 'ray', 'mindspore', 'vllm', 'pynvml'):\n"
            "    sys.modules[name] = None  # an import of it fails as if not installed\n"
            "sys.argv = ['pretuner', 'plan', '--model', 'qwen3-8b', '--card', '64']\n"
            "from pretuner.cli import main\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV" in proc.stdout
