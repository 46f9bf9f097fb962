"""A server's whole process tree is pretuner's: nothing it started outlives a SIGKILL of
pretuner, a Ctrl-C stops it without waiting out the stop grace, and every launch takes a model
folder whatever its name."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings, Purpose, Target
from pretuner.engines.mindspore_r01 import R01Engine
from pretuner.engines.vllm_v1 import ROWS, V1Engine
from pretuner.launch.process import ServerProcess
from pretuner.sim.argv import server_parser
from tests.helpers import cli_env, wait_for

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


def survivors(record: Path, mark: str, within_s: float = GONE_WITHIN_S) -> list[int]:
    """The tree's processes (recorded pids, and the /proc scan) still alive after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        recorded = [int(p) for p in record.read_text().split()] if record.exists() else []
        left = sorted({p for p in recorded if alive(p)} | set(marked(mark)))
        if not left or time.monotonic() > deadline:
            for pid in left:  # a failing test leaves nothing behind either
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return left
        time.sleep(0.1)


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
    assert survivors(record, mark) == [], stderr.read_text()
    assert all(not alive(p) for p in tree)
