"""The error hierarchy and the exit codes the CLI maps it to.

Every error a user can cause or meet carries a one-line message that names the offending
value and what to do. The CLI catches `PretunerError` once and exits with `exit_code`.
"""

from __future__ import annotations

import shlex
from enum import IntEnum
from pathlib import Path
from typing import Any


class ExitCode(IntEnum):
    """Documented exit codes of the `pretuner` command (see README, "Exit codes")."""

    OK = 0
    INTERNAL = 1
    BAD_INPUT = 2
    NOTHING_FOUND = 3
    INFEASIBLE = 4
    SERVER_FAILED = 5
    NOT_VALIDATED = 6
    CLUSTER = 7
    CARD_BUSY = 8
    LESS_THAN_ASKED = 9  # validated, but shorter, fewer sequences or slower than asked
    SWEEP_INCOMPLETE = 10  # `sweep`: a tuning did not end validated as asked (its own code)
    INTERRUPTED = 130

    @classmethod
    def of_finished_run(cls, validated: bool, validate: bool, given_up: bool) -> ExitCode:
        """`pretuner run`'s code for a run that finished: 6 when a proof was asked and did not
        hold, 9 when it held less than asked, else 0."""
        if not validated and validate:
            return cls.NOT_VALIDATED
        return cls.LESS_THAN_ASKED if given_up else cls.OK


class PretunerError(Exception):
    """Base of every error pretuner reports to a user."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # Set by `pretuner run` once the failure is written to its run folder: the folder, and
        # the report.json written there (what `run --json` prints).
        self.run_record: Path | None = None
        self.report: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class BadInputError(PretunerError):
    """A value given by the user is invalid (unknown model, card < 1, util out of range...)."""

    exit_code = ExitCode.BAD_INPUT


class UnknownModelError(BadInputError):
    """The model name matches no registry entry and no local folder."""

    def __init__(self, name: str, suggestions: list[str]) -> None:
        hint = (f"did you mean {', '.join(suggestions)}?" if suggestions
                else "run `pretuner models` for the list, or pass a local model folder")
        super().__init__(f"unknown model {name!r}", hint=hint)


class NothingFoundError(PretunerError):
    """The logs hold none of the lines the command needs."""

    exit_code = ExitCode.NOTHING_FOUND


class InfeasibleError(PretunerError):
    """The arithmetic says the requested configuration cannot fit on the card."""

    exit_code = ExitCode.INFEASIBLE


class ServerFailedError(PretunerError):
    """The server under test died, hung, or never became ready."""

    exit_code = ExitCode.SERVER_FAILED

    def __init__(self, message: str, *, hint: str | None = None,
                 log_path: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.log_path = log_path


class RequestRefusedError(PretunerError):
    """The server refused a request pretuner built (HTTP 4xx): pretuner's error, not its."""

    exit_code = ExitCode.INTERNAL


class NotValidatedError(PretunerError):
    """No configuration could be proven under load within the launch budget."""

    exit_code = ExitCode.NOT_VALIDATED


class ClusterError(PretunerError):
    """The Ray cluster cannot run the launch (unreachable, too few NPUs, a node not ready)."""

    exit_code = ExitCode.CLUSTER


class CardBusyError(PretunerError):
    """Another process holds so much of the card that no verdict about the model is possible."""

    exit_code = ExitCode.CARD_BUSY


class RunInterrupted(PretunerError):
    """Ctrl-C (or SIGTERM/SIGHUP) during a run: its folder stays resumable."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(self, run_folder: Path | None) -> None:
        command = ["pretuner", "run", "--resume", str(run_folder)]
        super().__init__("interrupted", hint=None if run_folder is None
                         else f"resume with: {shlex.join(command)}")
        self.run_record = run_folder
