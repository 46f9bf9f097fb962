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


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def proc_available() -> bool:
    return os.path.exists("/proc/self/stat")


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields from "state" (field 3) on; None when the process is gone."""
    # Through a bare descriptor, not a file object: this runs while a stop waits, where Ctrl-C
    # or SIGTERM (made KeyboardInterrupt) lands, and one landing between `open()` and `with`
    # would leak a file object (a ResourceWarning at collection). Once the descriptor is
    # stored, `try/finally` closes it; an interrupt inside the `os.open` call itself can at
    # worst drop a bare descriptor, which warns of nothing.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    return stat[stat.rfind(b")") + 2 :].split()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None  # gone meanwhile


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes whose process group is `pgid`, from /proc."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        # getpgid(2) asks the kernel directly: only the group's own members are read further.
        if not entry.isdigit() or _pgid(int(entry)) != pgid:
            continue
        fields = stat_fields(int(entry))
        # A zombie holds no memory; an orphaned one waits for init, which may never reap it.
        if fields and fields[0] not in (b"Z", b"X"):
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


def stop_group(
    pgid: int,
    grace_s: float,
    sig: int = signal.SIGTERM,
    reap: Callable[[], object] | None = None,
) -> bool:
    """Send `sig` to the whole group, wait up to `grace_s` for every member, then SIGKILL; True
    when it stopped before SIGKILL. A KeyboardInterrupt in the wait kills it at once."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
    try:
        if wait_group_gone(pgid, time.monotonic() + grace_s, reap=reap, grace_s=grace_s):
            return True
    except KeyboardInterrupt:
        kill_group(pgid, reap)
        raise
    note(
        f"server group {pgid} still running {grace_s:g} s after {signal.Signals(sig).name}; "
        "sending SIGKILL",
        logging.WARNING,
    )
    kill_group(pgid, reap)
    return False


def kill_group(pgid: int, reap: Callable[[], object] | None = None) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if not wait_group_gone(pgid, time.monotonic() + KILL_WAIT_S, reap=reap):
        log.error(
            "processes of group %d survive SIGKILL (uninterruptible?): %s",
            pgid,
            group_members(pgid) if proc_available() else "unknown",
        )
