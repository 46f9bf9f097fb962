"""The typer application, its global options, and the single error boundary."""

from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import typer

from pretuner import __version__
from pretuner.errors import ExitCode, PretunerError, RunInterrupted

app = typer.Typer(
    name="pretuner",
    help="Measure an LLM server's memory and derive the largest configuration that is safe.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@dataclass
class _GlobalState:
    debug: bool = False


state = _GlobalState()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pretuner {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logging."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    state.debug = debug
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def fail(message: str, code: ExitCode) -> None:
    typer.echo(f"pretuner: error: {message}", err=True)
    raise SystemExit(int(code))


GLOBAL_FLAGS = ("--debug", "--verbose", "-v")


def hoist_global_flags(argv: list[str]) -> list[str]:
    """`pretuner run ... --debug` read as `pretuner --debug run ...`: the global flags work
    after the subcommand too. A token that is an option's value, anything after `--`, and the
    emulated servers' own command lines (`pretuner sim ...`) are left where they are."""
    # Typer may carry its own click: the commands are read by what they have, not their class.
    cmd: Any = typer.main.get_command(app)
    i = 0
    while i < len(argv) and hasattr(cmd, "list_commands"):
        if argv[i].startswith("-"):
            i += 1
            continue
        sub = cmd.get_command(None, argv[i])
        if sub is None or argv[i] == "sim":
            return argv
        cmd, i = sub, i + 1
    takes_value = {
        name for p in cmd.params if not getattr(p, "is_flag", True) and not p.count
        for name in p.opts
    }  # fmt: skip
    own = {name for p in cmd.params for name in p.opts}
    head = argv[:i]
    rest: list[str] = []
    moved: list[str] = []
    j = i
    while j < len(argv):
        arg = argv[j]
        if arg == "--":
            rest += argv[j:]
            break
        if arg in takes_value:
            rest += argv[j : j + 2]
            j += 2
            continue
        (moved if arg in GLOBAL_FLAGS and arg not in own else rest).append(arg)
        j += 1
    if not moved:
        return argv
    return moved + head + rest


def main() -> None:
    """Console entry point: run the app, turn every known error into one line and an exit code.

    Usage errors (exit 2) and --help are typer's own. Typer turns a bare Ctrl-C into a silent
    exit 130; `run` raises `RunInterrupted` instead, printed here with the resume command.
    With --debug a `PretunerError` prints its traceback first and keeps its exit code.
    """
    try:
        app(args=hoist_global_flags(sys.argv[1:]))
    except RunInterrupted as err:
        typer.echo(f"pretuner: {err}", err=True)  # "interrupted; resume with: ..."
        raise SystemExit(int(err.exit_code)) from None
    except PretunerError as err:
        if state.debug:  # the traceback, and still the documented exit code
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        typer.echo("pretuner: interrupted", err=True)
        raise SystemExit(int(ExitCode.INTERRUPTED)) from None
