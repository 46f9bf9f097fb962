"""The server process tree, against a real fake server process on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pretuner.errors import ServerFailedError
from pretuner.launch.process import (
    ServerProcess,
    install_signal_handlers,
    raise_if_interrupted,
    read_tail,
)

FAKE = Path(__file__).parent / "fakes" / "fake_server.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def members(pgid: int) -> list[int]:
    """Live processes of a group, read from /proc independently of the code under test."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


class Fake:
    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/health"
        self.log_path = tmp_path / "logs" / "server.log"
        self.started: list[ServerProcess] = []

    def start(self, *flags: str) -> ServerProcess:
        argv = [sys.executable, str(FAKE), "--port", str(self.port), *flags]
        proc = ServerProcess.start(argv, dict(os.environ), self.log_path)
        self.started.append(proc)
        return proc


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Fake]:
    f = Fake(tmp_path)
    yield f
    for proc in f.started:  # never leave a process behind, whatever the test did
        proc.stop(grace_s=2.0)


@needs_proc
def test_ready_then_graceful_stop(fake: Fake) -> None:
    proc = fake.start()
    assert proc.alive
    assert proc.pgid == proc.pid
    seconds = proc.wait_ready(fake.url, timeout_s=20)
    assert 0 < seconds < 20
    result = proc.stop(grace_s=10)
    assert result.graceful
    assert not result.killed
    assert result.exit_code == 0
    assert members(proc.pgid) == []
    log_text = fake.log_path.read_text()
    assert "got SIGTERM" in log_text
    assert "actual peak used mem:1234M" in log_text
    assert proc.stop() is result  # idempotent


def test_dead_at_start_fails_fast_with_code_tail_and_path(fake: Fake) -> None:
    proc = fake.start("--die-at-start", "3")
    started = time.monotonic()
    with pytest.raises(ServerFailedError) as info:
        proc.wait_ready(fake.url, timeout_s=60)
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "exited with code 3" in message
    assert "fatal: cannot start (simulated)" in message
    assert str(fake.log_path) in message
    assert info.value.log_path == str(fake.log_path)
    assert proc.poll() == 3
    assert not proc.alive


@pytest.mark.slow
def test_hang_times_out(fake: Fake) -> None:
    proc = fake.start("--hang")
    with pytest.raises(ServerFailedError, match=r"not ready after 1\.5 s") as info:
        proc.wait_ready(fake.url, timeout_s=1.5)
    assert str(fake.log_path) in str(info.value)
    assert proc.alive
    assert proc.stop(grace_s=10).graceful


def test_check_raising_stops_waiting_at_once(fake: Fake) -> None:
    class OomSeen(Exception):
        pass

    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) >= 2:
            raise OomSeen("Out of Memory!!!")

    proc = fake.start("--hang")
    started = time.monotonic()
    with pytest.raises(OomSeen):
        proc.wait_ready(fake.url, timeout_s=60, check=check, interval_s=0.05)
    assert len(calls) == 2
    assert time.monotonic() - started < 30


@pytest.mark.slow
@needs_proc
def test_stop_waits_for_the_grandchild(fake: Fake) -> None:
    # The wrapper dies at once on SIGTERM; the real server (its child) needs 0.5 s more to
    # write its last lines, and stop must not return before it is gone.
    proc = fake.start("--wrapper", "--term-delay", "0.5")
    proc.wait_ready(fake.url, timeout_s=20)
    assert len(members(proc.pgid)) == 2
    result = proc.stop(grace_s=10)
    assert members(proc.pgid) == []
    assert result.graceful
    assert result.exit_code == -signal.SIGTERM  # the wrapper's own code says nothing
    assert result.seconds >= 0.4
    assert "actual peak used mem:1234M" in fake.log_path.read_text()


@pytest.mark.slow
@needs_proc
def test_ignoring_sigterm_gets_sigkill_after_grace(fake: Fake) -> None:
    proc = fake.start("--wrapper", "--ignore-term")
    proc.wait_ready(fake.url, timeout_s=20)
    result = proc.stop(grace_s=1.0)
    assert result.killed
    assert not result.graceful
    assert 0.9 < result.seconds < 15
    assert members(proc.pgid) == []
    assert "ignoring it" in fake.log_path.read_text()


@needs_proc
def test_context_manager_stops_on_keyboard_interrupt(fake: Fake) -> None:
    argv = [sys.executable, str(FAKE), "--port", str(fake.port), "--wrapper"]
    seen: list[ServerProcess] = []

    def interrupted() -> None:
        with ServerProcess.start(argv, dict(os.environ), fake.log_path) as proc:
            seen.append(proc)
            proc.wait_ready(fake.url, timeout_s=20)
            assert len(members(proc.pgid)) == 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert members(seen[0].pgid) == []
    assert not seen[0].alive


@pytest.mark.slow
@needs_proc
def test_interrupt_during_grace_kills_at_once(fake: Fake) -> None:
    proc = fake.start("--wrapper", "--ignore-term")
    proc.wait_ready(fake.url, timeout_s=20)
    restore = install_signal_handlers()
    timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            proc.stop(grace_s=60)
    finally:
        timer.cancel()
        restore()
    assert members(proc.pgid) == []
    result = proc.stop()
    assert result.killed
    assert result.seconds < 30


def test_missing_executable_is_a_server_error(tmp_path: Path) -> None:
    with pytest.raises(ServerFailedError, match="cannot start server"):
        ServerProcess.start([str(tmp_path / "nope")], {}, tmp_path / "x.log")


def terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises long before this ends


def test_sigterm_becomes_keyboard_interrupt() -> None:
    # Whatever handled SIGTERM before (SIG_DFL, or a handler a library installed earlier in this
    # worker, as ray.init does) is what handles it after.
    before = signal.getsignal(signal.SIGTERM)
    restore = install_signal_handlers()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            terminate_self()
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_a_sigterm_whose_raise_was_swallowed_still_stops_the_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: a SIGTERM that lands where Python swallows exceptions (Popen's at-fork hooks, a
    finalizer: "Exception ignored in ...") still stops the run at its next wait; once the
    handlers are restored it is forgotten."""
    import gc

    class Finalized:
        def __del__(self) -> None:
            terminate_self()

    restore = install_signal_handlers()
    try:
        swallowed: list[Any] = []
        monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
        Finalized()  # the KeyboardInterrupt is raised in __del__ and swallowed there
        gc.collect()
        monkeypatch.undo()
        assert [type(u.exc_value) for u in swallowed] == [KeyboardInterrupt]
        proc = ServerProcess.start([sys.executable, "-c", "import time; time.sleep(30)"],
                                   dict(os.environ), tmp_path / "server.log")
        with proc, pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            proc.wait_ready("http://127.0.0.1:9/health", timeout_s=20)
        assert proc.stop().seconds < 10
    finally:
        restore()
    raise_if_interrupted()  # forgotten: nothing raised


@pytest.mark.slow
@needs_proc
def test_atexit_stops_a_forgotten_server(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from pretuner.launch.process import ServerProcess
        argv = [sys.executable, {str(FAKE)!r}, "--port", "{port}", "--wrapper"]
        proc = ServerProcess.start(argv, dict(os.environ), Path({str(log_path)!r}))
        proc.wait_ready("http://127.0.0.1:{port}/health", timeout_s=20)
        print(proc.pgid)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    pgid = int(done.stdout.strip())
    assert members(pgid) == []
    assert "got SIGTERM" in log_path.read_text()


def test_read_tail(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    path.write_text("".join(f"line {i}\r\n" for i in range(100_000)))
    assert read_tail(path, 3) == "line 99997\nline 99998\nline 99999"
    assert read_tail(path, 0) == ""
    assert read_tail(tmp_path / "missing.log") == ""
    short = tmp_path / "short.log"
    short.write_text("only\n")
    assert read_tail(short, 40) == "only"
