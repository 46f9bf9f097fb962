"""Keep a server from outliving pretuner: the parent-death guard and the pid file.

The guard (Linux `PR_SET_PDEATHSIG`) makes the kernel signal the server when pretuner dies,
even by SIGKILL. It covers the process pretuner starts; a wrapper that starts the real server
as its own child (r0.1's launcher) must set it again for that child, which pretuner's emulated
launcher does and the real one does not. The pid file is the net under both: written next to
the launch's log while the group lives, it lets the next run name a survivor and `--resume`
stop its own.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pretuner.procgroups import group_alive, group_members, proc_available, stat_fields

log = logging.getLogger(__name__)

PID_FILE = "server.pid"
_PR_SET_PDEATHSIG = 1


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


def write_pid_file(path: Path, pid: int, pgid: int, argv: Sequence[str], started_at: float) -> None:
    """Record a started group; a failure to write is logged, never fatal to the launch."""
    info = ServerPid(pid, pgid, start_ticks(pid), _boot_id(), started_at, _port_of(argv),
                     path.parent.name, argv[0] if argv else "")
    doc = {k: v for k, v in asdict(info).items() if k != "path"}
    try:
        path.write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as err:
        log.warning("cannot write the pid file %s: %s", path, err)


def remove_pid_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


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
            remove_pid_file(path)  # the group ended without pretuner: a stale file
    return found
