"""Own a server's whole process tree: start it in its own session, wait until it answers,
stop every process of its group.

Why SIGTERM and not SIGINT: r0.1's `vllm_mindspore.entrypoints` runs the real server under
`subprocess.run`, which on SIGINT (KeyboardInterrupt) gives its child only 0.25 s before
killing it, and a killed server never prints MindSpore's memory-pool dump. SIGTERM is not
caught by that wrapper: it dies at once while the real server, in the same process group,
gets its own SIGTERM and shuts down cleanly. So `stop` signals the whole group and then
waits for every member, not only the process we started.

The server runs in a new session, so a Ctrl-C in the terminal reaches pretuner only; pretuner
then stops the group itself (context manager, `atexit`, `install_signal_handlers`), and a
`launch.watchdog` ends the whole tree when pretuner cannot (SIGKILL).
"""

from __future__ import annotations

import atexit
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from pretuner.errors import BadInputError, ServerFailedError
from pretuner.launch.probe import get_ok
from pretuner.launch.watchdog import Watchdog
from pretuner.procgroups import (
    PID_FILE,
    describe_exit,
    group_alive,
    parent_death_guard,
    stop_group,
    write_pid_file,
)
from pretuner.redact import redact_argv, redact_text

log = logging.getLogger(__name__)

_ATEXIT_GRACE_S = 10.0
_HEALTH_TIMEOUT_S = 2.0
_TAIL_LINES = 40
_TAIL_MAX_BYTES = 1 << 20

@dataclass(frozen=True, slots=True)
class StopResult:
    """How a server's process group ended."""

    exit_code: int | None  # the started process's (negative: killed by that signal; None: it
    # survived even SIGKILL)
    graceful: bool  # no SIGKILL: only then can MindSpore have printed its pool dump
    killed: bool  # SIGKILL was sent
    seconds: float


_live: set[ServerProcess] = set()
_live_lock = threading.Lock()


class ServerProcess:
    """A server started in its own session, its output in a log file."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, started: float,
                 watchdog: Watchdog) -> None:
        self._popen = popen
        self._watchdog = watchdog
        self.pid = popen.pid
        # start_new_session makes the child a session and group leader before exec.
        self.pgid = popen.pid
        self.log_path = log_path
        self._started = started
        self._stop_lock = threading.RLock()
        self._stop_result: StopResult | None = None
        self._pid_file = log_path.parent / PID_FILE

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], log_path: Path,
              cwd: Path | None = None) -> ServerProcess:
        """Start `argv` with exactly `env`, its output appended to `log_path`, `server.pid`
        beside it until the whole group is gone."""
        if not argv:
            raise ValueError("empty server command")
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Started first: a pretuner killed right after the server's start still has one.
        watchdog = Watchdog(log_path.parent / "watchdog.log")
        # Append: an earlier run's log is never overwritten.
        with open(log_path, "ab") as log_file:
            try:
                popen = subprocess.Popen(
                    argv, env={**env, **watchdog.env}, cwd=cwd, stdin=subprocess.DEVNULL,
                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                    close_fds=True, preexec_fn=parent_death_guard(),  # a prctl: safe after fork
                )
            except OSError as exc:
                watchdog.release()
                raise ServerFailedError(f"cannot start server {argv[0]!r}: {exc}",
                                        hint="check the executable and the working folder",
                                        log_path=str(log_path)) from exc
        started = time.monotonic()
        proc = cls(popen, log_path, started, watchdog)
        watchdog.guard(proc.pgid)
        write_pid_file(proc._pid_file, popen.pid, proc.pgid, argv, time.time(), watchdog.token)
        with _live_lock:
            _live.add(proc)
        log.info("started server pid %d (log %s): %s", popen.pid, log_path,
                 shlex.join(redact_argv(argv)))
        return proc

    @property
    def alive(self) -> bool:
        """True while the process we started runs (its children may outlive it)."""
        return self.poll() is None

    def poll(self) -> int | None:
        return self._popen.poll()

    def poll_settled(self, seconds: float) -> int | None:
        """The exit code once the process exited by itself, waiting up to `seconds` for it."""
        try:
            return self._popen.wait(max(0.0, seconds))
        except subprocess.TimeoutExpired:
            return None

    def _failure(self, what: str) -> ServerFailedError:
        tail = read_tail(self.log_path)
        message = f"server {what}; log: {self.log_path}"
        message += f"\nlast log lines:\n{tail}" if tail else "\n(the log is empty)"
        return ServerFailedError(message, log_path=str(self.log_path))

    def wait_ready(self, url: str, timeout_s: float, *, check: Callable[[], None] | None = None,
                   interval_s: float = 0.2) -> float:
        """The seconds since the start once `GET url` answers 200; each round first checks
        that the process lives, then runs `check` (which may raise: an OOM in the log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            raise_if_interrupted()
            code = self.poll()
            if code is not None:
                raise self._failure(f"{describe_exit(code)} before {url} answered")
            if check is not None:
                check()
            remaining = deadline - time.monotonic()
            if get_ok(url, max(0.05, min(_HEALTH_TIMEOUT_S, remaining))):
                ready = time.monotonic() - self._started
                log.info("server pid %d ready after %.1f s", self.pid, ready)
                return ready
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failure(f"not ready after {timeout_s:g} s ({url} never answered 200)")
            time.sleep(min(interval_s, remaining))

    def stop(self, grace_s: float = 30.0, sig: int = signal.SIGTERM) -> StopResult:
        """`procgroups.stop_group` on the server's group; idempotent: later calls return the
        first result. A KeyboardInterrupt in the grace period kills the group and propagates."""
        with self._stop_lock:
            if self._stop_result is not None:
                return self._stop_result
            started = time.monotonic()
            graceful = True
            if group_alive(self.pgid):
                log.info("stopping server group %d with %s", self.pgid, signal.Signals(sig).name)
                try:
                    graceful = stop_group(self.pgid, grace_s, sig, reap=self._popen.poll)
                except KeyboardInterrupt:
                    self._finish(killed=True, started=started)
                    raise
            return self._finish(killed=not graceful, started=started)

    def _finish(self, *, killed: bool, started: float) -> StopResult:
        try:
            exit_code: int | None = self._popen.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            exit_code = None
        result = StopResult(exit_code, not killed, killed, time.monotonic() - started)
        self._stop_result = result
        self._watchdog.release()  # whatever of the tree left the group is swept now
        if exit_code is not None and not group_alive(self.pgid):
            self._pid_file.unlink(missing_ok=True)
        with _live_lock:
            _live.discard(self)
        log.info("server group %d stopped: %s", self.pgid, result)
        return result

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerProcess(pid={self.pid}, log_path={str(self.log_path)!r})"


def read_tail(path: Path, n_lines: int = _TAIL_LINES) -> str:
    """The last `n_lines` lines of a text file, reading at most 1 MiB from its end."""
    if n_lines <= 0:
        return ""
    try:
        with open(path, "rb") as fh:
            start = max(0, fh.seek(0, os.SEEK_END) - _TAIL_MAX_BYTES)
            fh.seek(start)
            data = fh.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").replace("\r", "").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line is cut
    return redact_text("\n".join(lines[-n_lines:]))  # quoted in reports: no secret


def log_hint(path: Path, n_lines: int = 15) -> str:
    """`log PATH` and its last lines (when it has any), for a failed launch's hint."""
    tail = read_tail(path, n_lines)
    return f"log {path}" + (f"\nlast log lines:\n{tail}" if tail else "")


def stop_all(grace_s: float = _ATEXIT_GRACE_S) -> None:
    """Stop every server this process started and has not stopped yet."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        try:
            proc.stop(grace_s=grace_s)
        except Exception:  # a safety net must not stop at the first failure
            log.exception("could not stop %r", proc)


atexit.register(stop_all)


# The signal that asked this process to stop, kept until the handlers are restored: Python
# swallows an exception raised where it cannot propagate ("Exception ignored in ..."), and a
# SIGTERM that lands in Popen's at-fork hooks or in a finalizer would let a run go on to its end
# (seen in a sweep: a tuning told to stop finished, and its resume found it already done).
_interrupted: list[str] = []


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    _interrupted.append(signal.Signals(signum).name)  # no lock: safe in a handler
    raise KeyboardInterrupt(f"received {_interrupted[-1]}")


def raise_if_interrupted() -> None:
    """Raise again a SIGTERM or SIGHUP this process got, in case its first raise was swallowed."""
    if _interrupted:
        raise KeyboardInterrupt(f"received {_interrupted[-1]}")


def install_signal_handlers() -> Callable[[], None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt in the main thread; return a restorer."""
    # Python dies on SIGTERM without running `finally` blocks or `atexit`; as an exception it
    # unwinds through every `with ServerProcess...` so no server outlives pretuner.
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_signal_handlers must be called from the main thread")
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _interrupted.clear()

    return restore


def check_server_installed(base_cmd: list[str]) -> None:
    """Refuse, before a run folder exists, a server command whose program or Python module is
    not installed here (exit 2), instead of finding out from the first launch's log."""
    program = shutil.which(base_cmd[0])
    others = "pass the whole command with --serve-cmd, or --engine sim for the emulated card"
    if program is None:
        raise BadInputError(f"the server command {base_cmd[0]!r} is not on PATH",
                            hint=f"install the engine (pip install vllm-mindspore) in this "
                            f"environment, {others}")
    if len(base_cmd) > 2 and base_cmd[1] == "-m":
        module = base_cmd[2].split(".")[0]
        probe = subprocess.run(
            [program, "-c", f"import importlib.util, sys; "
             f"sys.exit(importlib.util.find_spec({module!r}) is None)"],
            capture_output=True, timeout=60, check=False,
        )
        if probe.returncode != 0:
            raise BadInputError(
                f"{base_cmd[0]} ({program}) cannot import {module!r}: the engine is not "
                "installed for it",
                hint=f"install the engine (pip install vllm-mindspore) for that Python, {others}")
