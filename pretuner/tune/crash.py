"""Failures that are no memory verdict: a server that crashed or answered an error without an
out-of-memory line, and a device that refused to start because another process holds it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pretuner.errors import CardBusyError, ServerFailedError
from pretuner.launch.process import read_tail

if TYPE_CHECKING:
    from pretuner.engines.outcome import LaunchOutcome


class DeviceBusyRefusal(CardBusyError):
    """The device refused to start the server because another process holds its memory
    (MindSpore: "free memory size is less than half of total ... may be other processes
    occupying this card"). The tuner adds what it knows of the card and who holds it."""

    def __init__(self, free_mib: int, log_path: str) -> None:
        super().__init__(f"the device refused to start: only {free_mib:,} MiB free")
        self.free_mib = free_mib
        self.source = "the device's refusal at start"
        self.log_path = log_path


# MindSpore refuses to initialise a device with less than half of it free.
_OCCUPIED = re.compile(r"Device HBM free size:\s?(\d+) may be other processes occupying")


def crash_error(o: LaunchOutcome, what: str) -> ServerFailedError:
    """Requests failed and the log holds no out-of-memory line: the server crashed or answered
    an error, which says nothing about memory, so the run ends here."""
    how = (
        f"the server crashed during the {what} ({_exit_words(o.server_exit_code)})"
        if o.server_exit_code is not None
        else f"the server answered the {what} with an error"
    )
    tail = read_tail(Path(o.log_path), 15)
    return ServerFailedError(
        f"{how} without an out-of-memory line: {o.request_error or 'no error text'}; "
        "this is a server failure, not a memory verdict",
        hint=f"fix the server (or its --serve-cmd) and run again; log {o.log_path}"
        + (f"\nlast log lines:\n{tail}" if tail else ""),
        log_path=o.log_path,
    )


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {-code}, exit code {code}"
    return f"exit code {code}"


def device_busy(log_path: Path) -> DeviceBusyRefusal | None:
    match = _OCCUPIED.search(read_tail(log_path, 40))
    return DeviceBusyRefusal(int(match.group(1)) // 2**20, str(log_path)) if match else None
