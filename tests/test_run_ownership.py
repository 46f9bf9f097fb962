"""A run owns its folder (lock), its servers (parent-death guard, pid file), its disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pretuner import procgroups as groups
from pretuner.errors import ExitCode
from pretuner.launch.process import ServerProcess
from pretuner.procgroups import PID_FILE, read_pid_file, report_stops_to, write_pid_file
from pretuner.tune.record import DiskFullError, FolderInUseError, RunRecord, lock_folder
from tests.helpers import cli_env, invoke, processes_holding, run_cli, wait_for

FAKE = Path(__file__).parent / "fakes" / "fake_server.py"
RUN = [sys.executable, "-m", "pretuner", "run", "--model", "qwen3-8b", "--engine", "sim", "--card",
       "64"]
needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")




def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return True
        if state in (b"Z", b"X"):
            return True
        time.sleep(0.05)
    return False


def _holder(folder: Path) -> subprocess.Popen[bytes]:
    """Another process holding the folder's lock, as a running pretuner would."""
    code = (
        "import sys, time; from pathlib import Path; from pretuner.tune.record import "
        "lock_folder; lock = lock_folder(Path(sys.argv[1])); print('locked', flush=True); "
        "time.sleep(120)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    assert holder.stdout is not None
    assert holder.stdout.readline() == b"locked\n"
    holder.stdout.close()
    return holder


def _interrupted_run(tmp_path: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A run whose pretuner was SIGKILLed while its first server loaded."""
    out = tmp_path / "run"
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as err:
        pt = subprocess.Popen([*RUN, "--out", str(out)], env=env, stdout=subprocess.DEVNULL,
                              stderr=err, stdin=subprocess.DEVNULL)  # fmt: skip
        try:
            wait_for(stderr_path, " loading ")
            wait_for(out / "launch-1" / PID_FILE, "pgid")
            pt.send_signal(signal.SIGKILL)
            pt.wait(timeout=30)
        finally:
            if pt.poll() is None:
                pt.kill()
    return out, out / "launch-1" / "server.log"


def test_lock_is_exclusive_across_processes_and_names_the_holder(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError, match=f"in use by pretuner pid {holder.pid}"):
            lock_folder(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_folder(tmp_path).release()  # free again once its holder is gone


@pytest.mark.slow
def test_two_runs_with_one_out_never_share_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = cli_env()
    procs = [
        subprocess.Popen([*RUN, "--out", str(out), "--no-validate", "--request-timeout", "60"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    results = [(p.wait(timeout=240), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "in use by pretuner pid" in refused or "not empty" in refused
    assert refused.count("\n") == 1  # one line
    journal = (out / "journal.jsonl").read_text().splitlines()
    assert sum('"run_started"' in line for line in journal) == 1
    assert json.loads(journal[0])["options"]["request_timeout_s"] == 60


@pytest.mark.slow
def test_resume_of_a_running_run_is_refused(tmp_path: Path) -> None:
    env = cli_env()
    out, _ = _interrupted_run(tmp_path, env)
    holder = _holder(out)
    try:
        res = invoke("run", "--resume", str(out), env=env)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == ExitCode.BAD_INPUT, res.stderr
    assert f"is in use by pretuner pid {holder.pid}" in res.stderr


@pytest.mark.slow
@needs_linux
def test_sigkill_of_pretuner_takes_its_server_along(tmp_path: Path) -> None:
    env = cli_env(PRETUNER_SIM_STARTUP_S="30")
    out, log = _interrupted_run(tmp_path, env)
    info = read_pid_file(out / "launch-1" / PID_FILE)
    assert info is not None
    assert _gone(info.pid), "the parent-death guard did not stop the server"
    deadline = time.monotonic() + 15
    while processes_holding(log) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_holding(log) == []
    # --resume starts launch 1 again in a fresh folder: the old log is moved aside.
    res = run_cli("run", "--resume", str(out), "--json", env=cli_env())
    assert res.returncode == 0, res.stderr
    assert (out / "launch-1.interrupted-1" / "server.log").exists()
    assert not (out / "launch-1" / PID_FILE).exists()


@pytest.mark.slow
@needs_linux
def test_an_orphan_is_named_by_a_new_run_and_stopped_by_resume(tmp_path: Path) -> None:
    env = cli_env()
    out, _ = _interrupted_run(tmp_path, env)
    # An orphan the guard cannot reach (a real r0.1 launcher's grandchild): started by hand.
    argv = [sys.executable, str(FAKE), "--port", "1", "--hang"]
    orphan = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        write_pid_file(out / "launch-1" / PID_FILE, orphan.pid, orphan.pid, argv, time.time())
        other = invoke("run", "--model", "qwen3-8b", "--engine", "sim", "--card", "64", "--out",
                       str(tmp_path / "other"), env=env)  # fmt: skip
        assert other.returncode == ExitCode.CARD_BUSY, other.stderr
        assert f"server pid {orphan.pid}" in other.stderr
        assert f"--resume {out}" in other.stderr
        assert other.stderr.count("\n") == 1
        res = run_cli("run", "--resume", str(out), env=env)
        assert res.returncode == 0, res.stderr
        assert f"server pid {orphan.pid}" in res.stderr
        assert "stopping it" in res.stderr
        assert orphan.wait(timeout=5) is not None
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_a_stale_pid_file_is_ignored_and_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = tmp_path / "launch-1" / PID_FILE
    path.parent.mkdir()
    write_pid_file(path, dead.pid, dead.pid, ["x", "--port", "8000"], time.time())
    info = read_pid_file(path)
    assert info is not None
    assert (info.port, info.launch) == (8000, "launch-1")
    assert groups.live_servers(tmp_path) == []
    assert not path.exists()


def test_pid_file_lives_while_the_group_does(tmp_path: Path) -> None:
    log = tmp_path / "launch-1" / "server.log"
    argv = [sys.executable, str(FAKE), "--port", "1", "--hang"]
    proc = ServerProcess.start(argv, dict(os.environ), log)
    info = read_pid_file(log.parent / PID_FILE)
    assert info is not None
    assert (info.pid, info.pgid) == (proc.pid, proc.pgid)
    assert groups.still_running(info)
    proc.stop(grace_s=5)
    assert not (log.parent / PID_FILE).exists()


@pytest.mark.slow
def test_a_slow_stop_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(groups, "_FIRST_NOTE_S", 0.3)
    monkeypatch.setattr(groups, "_NOTE_EVERY_S", 0.5)
    said: list[str] = []
    restore = report_stops_to(said.append)
    argv = [sys.executable, str(FAKE), "--port", "1", "--hang", "--ignore-term"]
    proc = ServerProcess.start(argv, dict(os.environ), tmp_path / "server.log")
    try:
        time.sleep(0.5)  # let it install its SIGTERM handler
        result = proc.stop(grace_s=1.2)
    finally:
        restore()
    assert result.killed
    assert said[0].startswith(f"SIGTERM sent to server group {proc.pgid}; waiting up to 1.2 s")
    assert any(m.startswith("still waiting for the server to stop") for m in said), said
    assert "sending SIGKILL" in said[-1]


def test_launch_refused_when_the_disk_is_nearly_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Usage:
        free = 10 << 20

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage())  # what the run record calls
    record = RunRecord(path=tmp_path)
    with pytest.raises(DiskFullError, match="only 10 MiB free") as err:
        record.launch_dir(1)
    assert err.value.exit_code == ExitCode.BAD_INPUT
    assert not (tmp_path / "launch-1").exists()


def test_a_full_disk_is_one_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("pretuner.tune.record.os.fsync", full)
    with pytest.raises(DiskFullError, match="No space left on device"):
        RunRecord(path=tmp_path).append("decision", what="x")
