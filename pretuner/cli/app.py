"""The typer application, its global options, and the single error boundary."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import typer
from typer.core import TyperGroup

from pretuner import __version__
from pretuner.cli.render import echo_json
from pretuner.errors import BadInputError, ExitCode, PretunerError, RunInterrupted
from pretuner.redact import redact_text, remember_secrets


class Group(TyperGroup):
    """A command group whose `--help`, when not given, reads False rather than None."""

    def get_help_option(self, ctx: Any) -> Any:
        # Typer (0.29) coerces every value but a bool with a pydantic adapter: an absent `--help`
        # of None imported pydantic (0.2 s) for a flag nobody gave (tests/test_cli_startup.py).
        option = super().get_help_option(ctx)
        if option is not None:
            option.default = False
        return option


app = typer.Typer(
    name="pretuner",
    help="Measure an LLM server's memory and derive the largest configuration that is safe.",
    epilog="""\b
Examples:
  pretuner run --model qwen3-8b --card 64          tune (emulated card if no NPU)
  pretuner run -m qwen3-8b --engine vllm --max-model-len 32K         a V1 engine
  pretuner plan --model deepseek-v3 --card 64      predict, launch nothing
  pretuner analyze server.log -m qwen3-8b          derive from your own pre-run
  pretuner script runs/<run> --out deploy/         the files for production

Exit codes: 0 success, 2 bad input, 3 nothing found, 4 infeasible, 5 server failed,
6 not validated, 7 Ray cluster, 8 card busy, 9 validated but less than asked (shorter,
fewer sequences, slower than --min-tokens-per-s), 10 a sweep's tuning not validated as asked,
130 interrupted (README: Exit codes).""",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None, cls=Group,
)


state = SimpleNamespace(debug=False)  # what the root callback saw, for the error boundary


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
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def error_json(err: PretunerError) -> dict[str, Any]:
    """A failed command's `--json`: the error, and `run`'s failure report if it has a folder."""
    head = {"error": err.message, "hint": err.hint, "exit_code": int(err.exit_code),
            "error_type": type(err).__name__,
            "run_record": str(err.run_record) if err.run_record is not None else None}
    return {**head, **{k: v for k, v in (err.report or {}).items() if k not in head}}


def wants_json(argv: list[str]) -> bool:
    """`--json` among the command's own flags (not after `--`)."""
    return "--json" in (argv[: argv.index("--")] if "--" in argv else argv)


GLOBAL_FLAGS = ("--debug", "--verbose", "-v")


def hoist_global_flags(argv: list[str]) -> list[str]:
    """`pretuner run ... --debug` read as `pretuner --debug run ...`: the global flags work
    after the subcommand too. A token that is an option's value, anything after `--`, and the
    emulated servers' own command lines (`pretuner sim ...`) are left where they are."""
    # Most command lines carry none: they spare building the command tree here, which
    # `app(...)` builds again (about 15 ms of every start).
    if not any(arg in GLOBAL_FLAGS for arg in argv):
        return argv
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


class Redacting:
    """stdout or stderr with every write through pretuner.redact (results, errors, logging)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact_text(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turn every known error into one line and an exit code
    (`argv`, sys.argv[1:] when not given, lets the tests run this very boundary in-process);
    no secret of its command line or environment is printed."""
    args = hoist_global_flags(sys.argv[1:] if argv is None else argv)
    remember_secrets(args, os.environ)
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Redacting(out), Redacting(err)
    try:
        _main(args)
    finally:
        sys.stdout, sys.stderr = out, err


def _main(args: list[str]) -> None:
    try:
        code = app(args=args, prog_name="pretuner", standalone_mode=False)
    except RunInterrupted as err:
        typer.echo(f"pretuner: {err}", err=True)  # "interrupted; resume with: ..."
        raise SystemExit(int(err.exit_code)) from None
    except PretunerError as err:
        fail(err, args)
    except OSError as err:
        if err.filename is None:  # not a path the user named: a bug, with its traceback
            raise
        # A path the system refused (too long, a folder, a file where a folder goes, busy):
        # whichever command met it, the user gave it and can give another.
        refused = BadInputError(f"cannot use {str(err.filename)!r}: {err.strerror or err}",
                                hint="pass another path")
        refused.__traceback__ = err.__traceback__
        fail(refused, args)
    except (KeyboardInterrupt, typer.Abort):  # click turns a Ctrl-C into Abort
        typer.echo("pretuner: interrupted", err=True)
        raise SystemExit(int(ExitCode.INTERRUPTED)) from None
    except typer.TyperException as err:  # click's usage errors (typer may carry its own click)
        usage_error(err, args)
    if isinstance(code, int) and code:
        raise SystemExit(code)


def fail(err: PretunerError, args: list[str]) -> None:
    """The one line (or `--json` object) of an error, and its documented exit code."""
    if wants_json(args):  # a script reads the failure as it reads a result
        echo_json(error_json(err))
    if state.debug:  # the traceback, and still the documented exit code
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    typer.echo(f"pretuner: error: {err}", err=True)
    raise SystemExit(int(err.exit_code)) from None


def usage_error(err: Exception, args: list[str]) -> None:
    """A flag or value the command does not take: one line naming it and where help is."""
    message = err.format_message() if hasattr(err, "format_message") else str(err)
    if message.startswith("Usage:"):  # a group or command given nothing: its help, as click does
        typer.echo(message, err=True)
        raise SystemExit(int(getattr(err, "exit_code", ExitCode.BAD_INPUT)))
    message = message.rstrip(".")
    ctx = getattr(err, "ctx", None)
    where = getattr(ctx, "command_path", None) or "pretuner"
    code = int(getattr(err, "exit_code", ExitCode.BAD_INPUT))
    if wants_json(args):
        echo_json({"error": message, "hint": f"see `{where} --help`", "exit_code": code,
                   "error_type": type(err).__name__, "run_record": None})
    typer.echo(f"pretuner: error: {message}; see `{where} --help`", err=True)
    raise SystemExit(code)
