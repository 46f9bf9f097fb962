"""The console entry point as a real process. The CLI tests call it in-process (tests/helpers.py
`invoke`); here the real process, `python -m pretuner` and the console script, answers as they
do: the same exit code, stdout and stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cli_env, invoke, run_cli

pytestmark = pytest.mark.slow  # each case starts the CLI as a process

OOM_LOG = Path(__file__).parent / "fixtures" / "logs" / "ms_cpu_oom.log"


@pytest.mark.parametrize("argv", [
    pytest.param(["--version"], id="version"),
    pytest.param(["plan", "--help"], id="help-wrapped-as-in-a-pipe"),
    pytest.param(["run", "--nosuch"], id="usage-error"),
    pytest.param(["plan", "--model", "deepseek-v4", "--card", "64", "--json"], id="json-error"),
    pytest.param(["analyze", str(OOM_LOG), "--model", "deepseek-v3", "--card", "64"],
                 id="exit-4"),
    pytest.param(["run", "--model", "qwen3-8b", "--card", "64", "--dry-run", "--verbose"],
                 id="verbose-after-the-subcommand"),
])  # fmt: skip
def test_a_real_process_answers_as_invoke_does(argv: list[str]) -> None:
    env = cli_env()  # one emulated card for both: its folder is in the dry run's command
    real = run_cli(*argv, env=env)
    inproc = invoke(*argv, env=env)
    assert (inproc.returncode, inproc.stdout, inproc.stderr) == (
        real.returncode, real.stdout, real.stderr)


def test_the_console_script_runs_main() -> None:
    script = Path(sys.executable).with_name("pretuner")
    assert script.is_file(), f"{script} is missing: pip install -e . puts it beside python"
    argv = ["plan", "--model", "deepseek-v4", "--card", "64"]
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120,
                          env=cli_env(), stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr == invoke(*argv).stderr
    assert done.stderr.startswith("pretuner: error: unknown model 'deepseek-v4'")
