"""Process groups: who is in one, waiting until it is gone, stopping one, telling the user when
a stop is slow (a server may take up to --stop-grace to dump its pool), and keeping a server
from outliving pretuner.

The parent-death guard (Linux `PR_SET_PDEATHSIG`) makes the kernel signal the server when
pretuner dies, even by SIGKILL. It covers the process pretuner starts; a wrapper that starts
the real server as its own child (r0.1's launcher) must set it again for that child, which
pretuner's emulated launcher does and the real one does not. `launch.watchdog` kills the rest of
the tree (a group member, a process that left the group) when pretuner dies. The pid file is the
net under all three: written next to the launch's log while the group lives, it lets the next
run name a survivor and `--resume` stop its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PID_FILE = "server.pid"
_PR_SET_PDEATHSIG = 1
POLL_S = 0.05
KILL_WAIT_S = 10.0

_FIRST_NOTE_S = 2.0  # a stop slower than this is announced, then every _NOTE_EVERY_S
_NOTE_EVERY_S = 10.0

Reporter = Callable[[str], None]
_reporter: list[Reporter] = []


def report_stops_to(report: Reporter) -> Callable[[], None]:
    """Send slow stops' progress to `report` (else the log, at INFO); return a restorer."""
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


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes whose process group is `pgid`, from /proc."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        # getpgid(2) asks the kernel directly: only the group's own members are read further.
        try:
            if not entry.isdigit() or os.getpgid(int(entry)) != pgid:
                continue
        except OSError:  # gone meanwhile
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


def wait_group_gone(pgid: int, deadline: float, *, reap: Callable[[], object] | None = None,
                    grace_s: float | None = None) -> bool:
    """Wait until group `pgid` is gone (False at `deadline`), saying so when it is slow."""
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
                note(f"SIGTERM sent to server group {pgid}; waiting up to {grace_s:g} s "
                     "(--stop-grace) for it to stop, then SIGKILL (Ctrl-C kills it now)")
            else:
                note(f"still waiting for the server to stop ({waited:.0f} s of --stop-grace "
                     f"{grace_s:g} s)")
            next_note = started + (waited // _NOTE_EVERY_S + 1) * _NOTE_EVERY_S
        time.sleep(POLL_S)


def stop_group(pgid: int, grace_s: float, sig: int = signal.SIGTERM,
               reap: Callable[[], object] | None = None) -> bool:
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
    note(f"server group {pgid} still running {grace_s:g} s after {signal.Signals(sig).name}; "
         "sending SIGKILL", logging.WARNING)
    kill_group(pgid, reap)
    return False


def kill_group(pgid: int, reap: Callable[[], object] | None = None) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if not wait_group_gone(pgid, time.monotonic() + KILL_WAIT_S, reap=reap):
        log.error("processes of group %d survive SIGKILL (uninterruptible?): %s", pgid,
                  group_members(pgid) if proc_available() else "unknown")


TREE_VAR = "PRETUNER_TREE"  # pretuner's own mark on a launch's processes, never an engine's


def carriers(token: str) -> list[int]:
    """Pids of the live processes whose environment holds `TREE_VAR=token` (a zombie has none):
    a launch's processes, also those that left its group or re-parented to init."""
    if not token or not proc_available():
        return []
    mark = f"\0{TREE_VAR}={token}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone, or another user's
            if mark in b"\0" + Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
    return found


def kill_tree(token: str, pgids: set[int]) -> list[int]:
    """SIGKILL a launch's processes (`carriers(token)`, members of `pgids`) until a scan finds
    none not killed yet (one forked meanwhile), or KILL_WAIT_S passed; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        # One killed may take seconds to exit (gigabytes to free): it needs no second signal.
        new = set(carriers(token)).union(*(group_members(g) for g in pgids)) - set(killed)
        if not new:
            break
        killed += sorted(new)
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)
    return killed


def parent_death_guard(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child when its parent dies; None
    where the OS offers no such guard, or off the main thread (the kernel fires it when the
    *thread* that forked exits, which would kill a server started from a worker thread)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def guard() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the guard was set
            os.kill(os.getpid(), sig)

    return guard


@dataclass(frozen=True, slots=True)
class ServerPid:
    """What identifies a started server group after pretuner is gone."""

    pid: int
    pgid: int
    start_ticks: int | None  # /proc/<pid>/stat field 22: tells a reused pid apart
    boot_id: str | None
    started_at: float  # wall clock, seconds since the epoch
    port: int | None
    launch: str  # the launch folder's name
    argv0: str
    path: str = ""  # where the pid file lies (not stored in it)
    tree: str = ""  # the launch's TREE_VAR mark ("": a file written before it existed)

    def describe(self) -> str:
        port = f", port {self.port}" if self.port is not None else ""
        return f"server pid {self.pid} (process group {self.pgid}{port}, {self.launch})"


def start_ticks(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _port_of(argv: Sequence[str]) -> int | None:
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--port" and i + 1 < len(argv) else None
        if arg.startswith("--port="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            return int(value)
    return None


def write_pid_file(path: Path, pid: int, pgid: int, argv: Sequence[str], started_at: float,
                   tree: str = "") -> None:
    """Record a started group; a failure to write is logged, never fatal to the launch."""
    info = ServerPid(pid, pgid, start_ticks(pid), _boot_id(), started_at, _port_of(argv),
                     path.parent.name, argv[0] if argv else "", tree=tree)
    doc = {k: v for k, v in asdict(info).items() if k != "path"}
    try:
        path.write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as err:
        log.warning("cannot write the pid file %s: %s", path, err)


def read_pid_file(path: Path) -> ServerPid | None:
    """The recorded server, or None for a missing or unreadable file."""
    try:
        doc = json.loads(path.read_text("utf-8"))
        return ServerPid(**{**doc, "path": str(path)})
    except (OSError, ValueError, TypeError):
        return None


def still_running(info: ServerPid) -> bool:
    """True while a process of the recorded group lives and is the one recorded."""
    # A pid is reused only once its group is gone, so a live member of `pgid` is ours unless
    # the machine rebooted (boot id) or it started before our server did (a reused group id).
    if info.boot_id is not None and _boot_id() not in (None, info.boot_id):
        return False
    if carriers(info.tree):  # marked with this launch's own random token: ours
        return True
    if info.start_ticks is None or not proc_available():
        return group_alive(info.pgid)
    return any((start_ticks(p) or 0) >= info.start_ticks for p in group_members(info.pgid))


def live_servers(run_folder: Path) -> list[ServerPid]:
    """Servers whose pid file lies in a launch folder of `run_folder` and that still run."""
    found = []
    for path in sorted(Path(run_folder).glob(f"launch-*/{PID_FILE}")):
        info = read_pid_file(path)
        if info is None:
            continue
        if still_running(info):
            found.append(info)
        else:
            path.unlink(missing_ok=True)  # the group ended without pretuner: a stale file
    return found
