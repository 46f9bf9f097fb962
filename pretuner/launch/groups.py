"""Process groups: who is in one, waiting until it is gone, stopping one, and telling the
user when a stop is slow (a server may take up to --stop-grace to dump its pool)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_S = 0.05
KILL_WAIT_S = 10.0

_FIRST_NOTE_S = 2.0  # a stop slower than this is announced, then every _NOTE_EVERY_S
_NOTE_EVERY_S = 10.0

Reporter = Callable[[str], None]
_reporter: list[Reporter] = []


def report_stops_to(report: Reporter) -> Callable[[], None]:
    """Send progress of slow stops (a line at 2 s, then every 10 s) to `report`; return a
    restorer. Without one they go to the log at INFO."""
    _reporter.append(report)
    return lambda: _reporter.remove(report) if report in _reporter else None


def note(message: str, level: int = logging.INFO) -> None:
    if _reporter:
        _reporter[-1](message)
    else:
        log.log(level, message)


def proc_available() -> bool:
    return os.path.exists("/proc/self/stat")


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes whose process group is `pgid`, from /proc."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 3:
            continue
        state, pgrp = fields[0], fields[2]
        # A zombie holds no memory; an orphaned one waits for init, which may never reap it.
        if state in (b"Z", b"X"):
            continue
        if pgrp.isdigit() and int(pgrp) == pgid:
            members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    if proc_available():
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_group_gone(
    pgid: int,
    deadline: float,
    *,
    reap: Callable[[], object] | None = None,
    grace_s: float | None = None,
) -> bool:
    """Wait until no process of group `pgid` is left; False at `deadline`. With `grace_s`
    (the wait after SIGTERM), a slow stop is reported: once at 2 s, then every 10 s."""
    started = time.monotonic()
    next_note = started + _FIRST_NOTE_S
    while True:
        if reap is not None:
            reap()
        if not group_alive(pgid):
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if grace_s is not None and now >= next_note:
            waited = now - started
            if next_note == started + _FIRST_NOTE_S:
                note(
                    f"SIGTERM sent to server group {pgid}; waiting up to {grace_s:g} s "
                    "(--stop-grace) for it to stop, then SIGKILL (Ctrl-C kills it now)"
                )
            else:
                note(
                    f"still waiting for the server to stop ({waited:.0f} s of --stop-grace "
                    f"{grace_s:g} s)"
                )
            next_note = started + (waited // _NOTE_EVERY_S + 1) * _NOTE_EVERY_S
        time.sleep(POLL_S)


def stop_group(pgid: int, grace_s: float) -> bool:
    """SIGTERM a group pretuner did not start in this process (an orphan), wait up to
    `grace_s`, then SIGKILL; True when it stopped before SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if wait_group_gone(pgid, time.monotonic() + grace_s, grace_s=grace_s):
        return True
    note(
        f"server group {pgid} still running {grace_s:g} s after SIGTERM; sending SIGKILL",
        logging.WARNING,
    )
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    wait_group_gone(pgid, time.monotonic() + KILL_WAIT_S)
    return False
