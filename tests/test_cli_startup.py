"""`pretuner --help`, a command's help and a usage error answer at once (docs/benchmarks.md).

The rule, not a stopwatch: answering them loads no library behind a command. Each command
imports its library inside the function that runs it; only typer, the option vocabulary and
the small pure modules the help texts name (model registry, method constants) load up front.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Loaded by a command when it runs, never to print help or refuse a flag.
HEAVY = ("numpy", "pydantic", "jinja2", "requests", "rich", "yaml", "pretuner.tune",
         "pretuner.analyze.r01", "pretuner.logscan", "pretuner.launch", "pretuner.engines",
         "pretuner.sim", "pretuner.devices", "pretuner.presets", "pretuner.report.html",
         "pretuner.deploy.context", "pretuner.deploy.render", "pretuner.cli.progress",
         "pretuner.report.records")

# Runs every argv given (or every command's --help) through the console entry point in one
# fresh interpreter; prints each exit code and the HEAVY modules loaded by the end.
PROBE = """
import contextlib, io, json, sys
argvs, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
from pretuner.cli import app, main
if argvs == "every --help":
    import typer
    def walk(cmd, path):
        if getattr(cmd, "add_help_option", True):  # not `sim serve`: the server's own argv
            yield [*path, "--help"]
        for name in getattr(cmd, "list_commands", lambda ctx: [])(None):
            yield from walk(cmd.get_command(None, name), [*path, name])
    argvs = list(walk(typer.main.get_command(app), []))
codes = {}
for argv in argvs:
    sys.argv = ["pretuner", *argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main()
            codes[" ".join(argv)] = 0
        except SystemExit as exc:
            codes[" ".join(argv)] = exc.code
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
print(json.dumps({"codes": codes, "loaded": loaded}))
"""


def _probe(argvs: list[list[str]] | str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs), json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


def test_importing_the_cli_loads_no_library() -> None:
    assert _probe([])["loaded"] == []


def test_every_help_page_loads_no_library() -> None:
    result = _probe("every --help")
    codes = result["codes"]
    assert isinstance(codes, dict)
    assert {"--help", "run --help", "script --help", "presets add --help"} <= set(codes)
    assert set(codes.values()) == {0}
    assert result["loaded"] == []


@pytest.mark.parametrize("argv", [
    ["run", "--nosuch"],          # no such option
    ["nosuch"],                   # no such command
    ["plan", "--model"],          # an option without its value
    ["script", "--target"],
])  # fmt: skip
def test_a_usage_error_loads_no_library(argv: list[str]) -> None:
    result = _probe([argv])
    assert result["codes"] == {" ".join(argv): 2}
    assert result["loaded"] == []


def test_a_bad_value_loads_only_typer_s_validator() -> None:
    """typer checks a value's type with pydantic (its message is pydantic's); nothing more."""
    result = _probe([["run", "--card", "abc"]])
    assert result["codes"] == {"run --card abc": 2}
    loaded = result["loaded"]
    assert isinstance(loaded, list)
    assert [m for m in loaded if m.partition(".")[0] != "pydantic"] == []


def test_scan_loads_the_scanner_and_not_the_report_records(tmp_path: Path) -> None:
    """`pretuner scan --json` is the command the log-scan benchmark times against grep: it
    loads the scanner (numpy) and typer's validator, not the report's pydantic records (50 ms)."""
    log = tmp_path / "server.log"
    log.write_text(  # the summary line of a real MindSpore pool dump
        '[INFO] PRE_ACT(1,ffff,python):2025-01-01-00:00:00.000.000 [x.cc:1] Dump] '
        'The dynamic memory pool stat info : {"in used mem":900.00MB}, actual peak used '
        "mem:1024M. Weight used size:0M, constant value used size:0M, kernel output used "
        "size:0M, other used size:900M.\n"
    )
    result = _probe([["scan", "--json", str(log)]])
    assert result["codes"] == {f"scan --json {log}": 0}
    loaded = result["loaded"]
    assert isinstance(loaded, list)
    assert "pretuner.logscan" in loaded
    assert "pretuner.report.records" not in loaded
