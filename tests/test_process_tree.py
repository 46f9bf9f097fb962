"""A server's whole process tree is pretuner's: nothing it started outlives a SIGKILL of
pretuner, a Ctrl-C stops it without waiting out the stop grace, and every launch takes a model
folder whatever its name."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings, Purpose, Target
from pretuner.engines.mindspore_r01 import R01Engine
from pretuner.engines.vllm_v1 import ROWS, V1Engine
from pretuner.launch import probe
from pretuner.launch.process import ServerProcess
from pretuner.procgroups import KILL_WAIT_S, PID_FILE, TREE_VAR, live_servers, write_pid_file
from pretuner.sim.argv import server_parser
from pretuner.tune.record import stop_own_orphans
from tests.helpers import cli_env, default_sigint, wait_for

SETTINGS = LaunchSettings(Purpose.VALIDATE, card_gib=80, util=0.9, model_use_gib=0,
                          max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=8192,
                          block_size=16, tp=1, kv_cache_bytes=2**34)


@pytest.mark.parametrize("engine", [V1Engine(ROWS["vllm"], simulated=False),
                                    R01Engine("vllm-mindspore-r01", False, "0.1.0", "test")],
                         ids=["v1", "r01"])
def test_a_model_folder_named_like_a_flag_reaches_the_server_as_its_value(
        engine: V1Engine | R01Engine) -> None:
    # Seen: a folder named `-rf` is served under the name `-rf`, and `--served-model-name -rf`
    # made the server's parser (argparse, as vLLM's) take `-rf` for flags: every launch exit 2.
    cmd = engine.command(SETTINGS, Target("/models/-rf", "-rf", "127.0.0.1", 8000))
    start = cmd.argv.index("/models/-rf") if "/models/-rf" in cmd.argv else 0
    parser = server_parser("vllm serve", "", "")
    ns, _ = parser.parse_known_args(cmd.argv[start:])
    assert (ns.model or ns.model_tag) == "/models/-rf"
    assert ns.served_model_name == ["-rf"]
    assert ns.max_model_len == 4096


FAKE_TREE = Path(__file__).parent / "fakes" / "daemonising_server.py"
GONE_WITHIN_S = 10.0  # issue 28: no engine process 10 s after pretuner's SIGKILL


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, killed and waiting for its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def marked(mark: str) -> list[int]:
    """Pids of live processes whose environment holds `mark` (the test's, inherited)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
    return [pid for pid in found if alive(pid) and pid != os.getpid()]


def survivors(record: Path, mark: str, within_s: float = GONE_WITHIN_S) -> list[str]:
    """The tree's processes (recorded pids, and the /proc scan) still alive after `within_s`,
    as "pid: command line"."""
    deadline = time.monotonic() + within_s
    while True:
        recorded = [int(p) for p in record.read_text().split()] if record.exists() else []
        left = sorted({p for p in recorded if alive(p)} | set(marked(mark)))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    named = []
    for pid in left:  # named, then killed: a failing test leaves nothing behind either
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            named.append(f"{pid}: {command.decode(errors='replace')[:300]}")
            os.kill(pid, signal.SIGKILL)
    return named


def tree_env(tmp_path: Path) -> tuple[dict[str, str], Path, str]:
    mark = f"TREE_TEST_MARK={uuid.uuid4().hex}"
    record = tmp_path / "tree.pids"
    env = cli_env(TREE_RECORD=str(record), **dict([mark.split("=")]))
    return env, record, mark


def wait_recorded(record: Path, count: int, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = record.read_text().split() if record.exists() else []
        if len(pids) >= count:
            return [int(p) for p in pids]
        time.sleep(0.05)
    raise AssertionError(f"the fake tree recorded {record.read_text()!r}, not {count} pids")


def test_sigkill_of_pretuner_leaves_no_process_of_the_servers_tree(tmp_path: Path) -> None:
    # A server's child in its group and a grandchild that daemonised both outlived pretuner's
    # SIGKILL (the parent-death signal reaches only the server): the watchdog kills the tree.
    env, record, mark = tree_env(tmp_path)
    driver = ("import sys, time\nfrom pathlib import Path\n"
              "from pretuner.launch.process import ServerProcess\n"
              f"ServerProcess.start([sys.executable, {str(FAKE_TREE)!r}], dict(__import__('os')"
              f".environ), Path({str(tmp_path / 'launch-1' / 'server.log')!r}))\n"
              "time.sleep(600)\n")
    pt = subprocess.Popen([sys.executable, "-c", driver], env=env, stdin=subprocess.DEVNULL)
    try:
        tree = wait_recorded(record, 3)
        assert all(alive(p) for p in tree)
        pt.kill()
        pt.wait(timeout=10)
    finally:
        if pt.poll() is None:
            pt.kill()
            pt.wait()
    assert survivors(record, mark) == []
    said = (tmp_path / "launch-1" / "watchdog.log").read_text()
    assert "pretuner died" in said
    assert all(str(p) in said for p in tree[1:])  # the escaped ones, by pid


def test_a_stop_also_ends_the_processes_that_left_the_servers_group(tmp_path: Path) -> None:
    # Stopping the group misses a daemonised grandchild; the stop sweeps it too.
    env, record, mark = tree_env(tmp_path)
    proc = ServerProcess.start([sys.executable, str(FAKE_TREE)], env, tmp_path / "server.log")
    try:
        wait_recorded(record, 3)
    finally:
        proc.stop(grace_s=2.0)
    assert survivors(record, mark, within_s=0.0) == []
    assert "after the stop" in (tmp_path / "watchdog.log").read_text()


@pytest.mark.slow
def test_sigkill_of_a_run_during_the_load_leaves_no_process_of_a_wrapped_server(
        tmp_path: Path) -> None:
    # The whole pipeline, an emulated V1 server behind a --serve-cmd wrapper whose tree escapes
    # its group as vLLM's does; pretuner is SIGKILLed while its requests are in flight.
    env, record, mark = tree_env(tmp_path)
    env.update(PRETUNER_SIM_TIME_SCALE="1")  # a load that lasts long enough to be killed in
    serve = shlex.join([sys.executable, str(FAKE_TREE), "-m", "pretuner.sim", "vllm", "serve"])
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        pt = subprocess.Popen(
            [sys.executable, "-m", "pretuner", "run", "--model", "qwen3-8b", "--engine", "vllm",
             "--emulate", "--card", "80", "--max-model-len", "8192", "--serve-cmd", serve,
             "--out", str(tmp_path / "run")], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_for(stderr, " load ")
            tree = wait_recorded(record, 3)
            pt.kill()
            pt.wait(timeout=10)
        finally:
            if pt.poll() is None:
                pt.kill()
                pt.wait()
    assert survivors(record, mark) == [], stderr.read_text()
    assert all(not alive(p) for p in tree)


@pytest.mark.slow
def test_ctrl_c_during_the_load_stops_the_server_at_once_not_after_the_stop_grace(
        tmp_path: Path) -> None:
    # Seen on real vLLM: on Ctrl-C pretuner's own requests were still open, the server's
    # graceful stop waited for them ("Waiting for connections to close") and pretuner for the
    # whole --stop-grace (120 s). The emulated server waits as uvicorn does; pretuner cuts its
    # requests before the SIGTERM.
    out = tmp_path / "run"
    stderr = tmp_path / "stderr.txt"
    env = cli_env(PRETUNER_SIM_TIME_SCALE="3")  # a load of about 30 s, interrupted early
    with open(stderr, "w") as err:
        pt = subprocess.Popen(
            [sys.executable, "-m", "pretuner", "run", "--model", "qwen3-8b", "--engine", "vllm",
             "--emulate", "--card", "80", "--max-model-len", "8192", "--out", str(out)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            preexec_fn=default_sigint)
        try:
            wait_for(stderr, " concurrent requests of ")
            time.sleep(2.0)  # the requests sent, the server busy with them
            interrupted = time.monotonic()
            pt.send_signal(signal.SIGINT)
            code = pt.wait(timeout=150)
            took = time.monotonic() - interrupted
        finally:
            if pt.poll() is None:
                pt.kill()
                pt.wait()
    assert code == 130, stderr.read_text()
    assert took < 20.0, f"Ctrl-C took {took:.1f} s (the stop grace is 120 s)"
    log = max(out.glob("launch-*/server.log")).read_text()
    assert "[shutdown]" in log  # a graceful stop, not a kill...
    assert "Waiting for connections to close" not in log  # ...with none of pretuner's left open


class _Hold(BaseHTTPRequestHandler):
    """Reads a request and never answers: a server still busy with it."""

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.held.set()  # type: ignore[attr-defined]
        while self.rfile.read(1):  # until the client closes its end
            pass


def test_the_end_of_a_servers_request_scope_cuts_its_open_requests_in_every_thread() -> None:
    # The rule under the Ctrl-C fix: leaving `probe.bearer` (as Ctrl-C does) ends the requests
    # sent from within, also those of load threads, and starts no new one.
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hold)
    server.held = threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    outcomes: list[probe.CompletionOutcome | None] = []
    try:
        with probe.bearer(base, None):
            calls = [functools.partial(probe.complete, base, "m", [1], 1, 60.0)] * 2
            sender = threading.Thread(target=contextvars.copy_context().run, args=(
                lambda: outcomes.extend(probe.send_all(calls, 60.0, name="t", workers=1)),))
            sender.start()
            assert server.held.wait(10)  # type: ignore[attr-defined]
            started = time.monotonic()
        sender.join(10)
        assert time.monotonic() - started < 5.0
        assert not sender.is_alive()
        assert [o.ok if o else None for o in outcomes] == [False, False]  # cut, then refused
        assert all(o and o.status == 0 for o in outcomes)
    finally:
        server.shutdown()
        server.server_close()


def test_resume_stops_a_process_of_a_recorded_tree_that_left_its_group(tmp_path: Path) -> None:
    # The net under the watchdog (killed with pretuner, say): server.pid records the launch's
    # mark, and --resume finds and stops a process of the tree outside the group.
    token = uuid.uuid4().hex
    escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                               env={**os.environ, TREE_VAR: token}, start_new_session=True)
    try:
        gone = subprocess.run(["true"], check=True)  # noqa: S607 - a pid whose group is gone
        launch = tmp_path / "launch-1"
        launch.mkdir()
        write_pid_file(launch / PID_FILE, os.getpid() + 10**6, 10**6 + 1, ["vllm"],
                       time.time(), token)
        assert gone.returncode == 0
        (found,) = live_servers(tmp_path)
        said: list[str] = []
        stop_own_orphans(tmp_path, 1.0, said.append)
        assert escaped.wait(timeout=KILL_WAIT_S) == -signal.SIGKILL
        assert not (launch / PID_FILE).exists()
        assert found.tree == token
    finally:
        if escaped.poll() is None:
            escaped.kill()
