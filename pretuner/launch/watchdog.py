"""`python -m pretuner.launch.watchdog FD TOKEN PID`: kill a server's whole tree once pretuner
dies.

Why a process of its own: `PR_SET_PDEATHSIG` reaches only the process pretuner starts, and a
process group only the processes that stay in it. Real vLLM's EngineCore, Worker and
multiprocessing resource tracker outlived a SIGKILL of pretuner under init, holding the card.
The watchdog runs in its own session (a Ctrl-C or a kill of pretuner's group misses it) and
blocks on a pipe whose only writer is pretuner: end of file means pretuner has stopped the
server or died, by any signal. It then kills every process whose environment carries the
launch's token (`TREE_VAR`, inherited by every descendant, also one that re-parented to init or
started its own session; the idea of Jenkins' ProcessTreeKiller) and every member of the
process groups pretuner wrote to the pipe. What it killed goes to its stderr: `watchdog.log` in
the launch folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from pretuner.procgroups import KILL_WAIT_S, TREE_VAR, kill_tree


class Watchdog:
    """pretuner's end of a launch's watchdog: `env` marks the server's processes, `guard(pgid)`
    adds a group, `release()` (after the stop) has it sweep what is left and waits for it."""

    def __init__(self, log_path: Path) -> None:
        self.token = uuid.uuid4().hex
        self.env = {TREE_VAR: self.token}
        read, self._write = os.pipe()
        root = str(Path(__file__).resolve().parents[2])  # this pretuner, wherever it runs from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        env.pop(TREE_VAR, None)  # the watchdog is not part of the tree it kills
        try:
            with open(log_path, "ab") as log_file:
                self._popen: subprocess.Popen[bytes] | None = subprocess.Popen(
                    [sys.executable, "-m", "pretuner.launch.watchdog", str(read), self.token,
                     str(os.getpid())],
                    env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                    pass_fds=(read,), start_new_session=True)
        except OSError:
            self._popen = None  # no watchdog: the parent-death signal and the pid file remain
        finally:
            os.close(read)

    def guard(self, pgid: int) -> None:
        with contextlib.suppress(OSError):
            os.write(self._write, f"{pgid}\n".encode())

    def release(self, wait_s: float = KILL_WAIT_S + 1.0) -> None:
        """Close the pipe (idempotent); the watchdog sweeps the tree's leftovers and exits."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(wait_s)


def main(argv: list[str]) -> None:
    read, token, pretuner = int(argv[0]), argv[1], int(argv[2])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only end of file ends it
    received = b""
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while chunk := pipe.read(4096):
            received += chunk
    pgids = {int(word) for word in received.split()}
    killed = kill_tree(token, pgids)
    if killed:
        alive = os.getppid() == pretuner  # else re-parented: pretuner is gone
        sys.stderr.write(f"pretuner watchdog: {'after the stop' if alive else 'pretuner died'}; "
                         f"killed pids {sorted(killed)} (token {token}, process groups "
                         f"{sorted(pgids)})\n")


if __name__ == "__main__":
    main(sys.argv[1:])
