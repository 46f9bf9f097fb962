"""`pretuner run --serve-cmd` against the fault-injecting stub (tests/fakes/fake_server.py):
every failure named for what it is, never a memory verdict; each case bounded to seconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretuner.devices.npu_smi import parse_npu_processes
from pretuner.tune.busy import describe_holders, looks_busy
from tests.helpers import cli_env, processes_holding, run_cli

FAKE = Path(__file__).parent / "fakes" / "fake_server.py"
pytestmark = pytest.mark.slow


def run_fault(tmp_path: Path, fault: str, *extra: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = f"{sys.executable} {FAKE} --fault {fault}"
    return run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd", cmd,
                   "--ready-timeout", "5", "--stop-grace", "1", "--out", str(tmp_path / "r"),
                   *extra, env=env, timeout=60)  # fmt: skip


def test_server_dying_on_the_probe_is_a_server_failure(tmp_path: Path) -> None:
    proc = run_fault(tmp_path, "die-on-probe")
    assert proc.returncode == 5, proc.stderr
    assert "the server crashed during the pre-run's probe (exit code 7)" in proc.stderr, proc.stderr
    assert "without an out-of-memory line" in proc.stderr
    assert "not a memory verdict" in proc.stderr
    assert str(tmp_path / "r" / "launch-1" / "server.log") in proc.stderr
    assert "segmentation fault" in proc.stderr  # the log tail
    assert "add cards" not in proc.stderr
    assert not (tmp_path / "r" / "launch-2").exists()  # ended at once: one launch


def test_http_500_without_oom_is_a_server_failure(tmp_path: Path) -> None:
    proc = run_fault(tmp_path, "http-500")
    assert proc.returncode == 5, proc.stderr
    assert "answered the pre-run's probe with an error without an out-of-memory line" in (
        proc.stderr
    )
    assert "HTTP 500" in proc.stderr
    assert "server.log" in proc.stderr
    assert not (tmp_path / "r" / "launch-2").exists()


def test_a_request_the_server_refuses_is_pretuners_error(tmp_path: Path) -> None:
    """HTTP 400 to pretuner's own probe: exit 1 with the server's message, never "server
    failed" (the server is healthy; the request was ours)."""
    proc = run_fault(tmp_path, "vocab", env=cli_env(FAKE_SERVER_VOCAB="20000"))
    assert proc.returncode == 1, proc.stderr
    assert "HTTP 400: Token id" in proc.stderr
    assert "is out of vocabulary" in proc.stderr
    assert "pretuner's error" in proc.stderr
    assert "server failed" not in proc.stderr.lower()
    assert not (tmp_path / "r" / "launch-2").exists()
    assert processes_holding(tmp_path / "r" / "launch-1" / "server.log") == []


def test_probe_token_ids_stay_in_a_small_vocabulary(tmp_path: Path) -> None:
    """A model whose vocabulary has 4,096 ids gets a probe the server accepts."""
    model = tmp_path / "small-vocab"
    shutil.copytree(Path(__file__).parent / "fixtures" / "models" / "tiny-qwen3", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    cmd = f"{sys.executable} {FAKE} --fault vocab"
    proc = run_cli("run", "--model", str(model), "--card", "64", "--serve-cmd", cmd,
                   "--ready-timeout", "5", "--stop-grace", "1", "--out", str(tmp_path / "r"),
                   env=cli_env(FAKE_SERVER_VOCAB="4096"), timeout=60)  # fmt: skip
    log = (tmp_path / "r" / "launch-1" / "server.log").read_text()
    ids = [(int(lo), int(hi)) for lo, hi in re.findall(r"prompt token ids (\d+)-(\d+)", log)]
    assert ids, log
    assert all(0 < lo <= hi < 4096 for lo, hi in ids), ids
    assert "out of vocabulary" not in proc.stderr
    assert proc.returncode != 1, proc.stderr


def test_hanging_server_times_out(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd",
                   f"{sys.executable} {FAKE} --fault hang", "--ready-timeout", "2",
                   "--stop-grace", "1", "--out", str(tmp_path / "r"), timeout=60)  # fmt: skip
    assert proc.returncode == 5, proc.stderr
    assert "not ready after 2 s" in proc.stderr
    assert time.monotonic() - started < 30
    assert processes_holding(tmp_path / "r" / "launch-1" / "server.log") == []


def test_server_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = run_fault(tmp_path, "ignore-term")
    assert proc.returncode == 5, proc.stderr
    assert "killed" in proc.stderr
    assert time.monotonic() - started < 30
    log = (tmp_path / "r" / "launch-1" / "server.log").read_text()
    assert "got SIGTERM, ignoring it" in log
    started_line = re.search(r"fake\[(\d+)\] starting", log)
    assert started_line is not None, log
    pid = int(started_line.group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert processes_holding(tmp_path / "r" / "launch-1" / "server.log") == []


def test_garbage_output_is_no_crash(tmp_path: Path) -> None:
    proc = run_fault(tmp_path, "garbage")
    assert proc.returncode == 5, proc.stderr  # no pool dump: a server failure, named
    assert "Traceback" not in proc.stderr
    assert "memory-pool dump" in proc.stderr
    assert b"\xff\xfe garbage" in (tmp_path / "r" / "launch-1" / "server.log").read_bytes()


def _tenant(env: dict[str, str], mib: int) -> subprocess.Popen[bytes]:
    tenant = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", "0", "--fault", "busy"],
        env={**env, "FAKE_SERVER_HOLD_MIB": str(mib)}, stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert tenant.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if b"busy: holding" in tenant.stdout.readline():
            return tenant
    tenant.kill()
    tenant.wait(timeout=10)
    tenant.stdout.close()
    raise AssertionError("the tenant never took the card")


@pytest.mark.parametrize("serve_cmd", [True, False], ids=["serve-cmd", "emulated-server"])
def test_busy_card_names_the_tenant(tmp_path: Path, serve_cmd: bool) -> None:
    env = cli_env()
    tenant = _tenant(env, 60000)
    try:
        args = ["--serve-cmd", f"{sys.executable} {FAKE}"] if serve_cmd else []
        proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", *args,
                       "--out", str(tmp_path / "r"), env=env, timeout=60)  # fmt: skip
    finally:
        tenant.terminate()
        tenant.wait(timeout=10)
        if tenant.stdout is not None:
            tenant.stdout.close()
    assert proc.returncode == 8, proc.stderr
    assert "the card is busy: 2,157 MiB" in proc.stderr
    assert f"pid {tenant.pid}" in proc.stderr
    assert "does not fit" not in proc.stderr
    assert "add cards" not in proc.stderr
    assert not (tmp_path / "r" / "launch-1").exists()  # refused before any launch


def test_device_refusal_on_a_busy_card(tmp_path: Path) -> None:
    """npu-smi left room for a pool, the device refuses (less than half free): card busy."""
    env = cli_env(PRETUNER_SIM_OCCUPIED_MIB="40000")
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--out", str(tmp_path / "r"),
                   env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 8, proc.stderr
    assert "the device's refusal at start" in proc.stderr
    assert "pid 4242" in proc.stderr
    assert "util -" not in (tmp_path / "r" / "journal.jsonl").read_text()


def test_card_nearly_full_never_derives_a_negative_util(tmp_path: Path) -> None:
    env = cli_env(PRETUNER_SIM_OCCUPIED_MIB="63000")
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--out", str(tmp_path / "r"),
                   "--json", env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 8, proc.stderr
    assert '"util": -' not in (tmp_path / "r" / "journal.jsonl").read_text()
    assert "0 MiB of its 65,536 MiB free" in proc.stderr


NPU_SMI_TABLE = """\
+===========================+===============+====================================================+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 1234          | python3                  | 40000                   |
+===========================+===============+====================================================+
| No running processes found in NPU 1                                                            |
+===========================+===============+====================================================+
| 2       1                 | 99            | vllm                     | 512                     |
+===========================+===============+====================================================+
"""


def test_npu_smi_process_table() -> None:
    procs = parse_npu_processes(NPU_SMI_TABLE)
    assert [(p.npu_id, p.chip, p.pid, p.name, p.memory_mib) for p in procs] == [
        (0, 0, 1234, "python3", 40000), (2, 1, 99, "vllm", 512)]  # fmt: skip
    assert describe_holders(procs) == (
        "pid 1234 (python3, 40,000 MiB on NPU 0); pid 99 (vllm, 512 MiB on NPU 2)"
    )
    assert parse_npu_processes("no table here") == ()


@pytest.mark.parametrize(
    ("free_mib", "holders", "busy"),
    [(61457, False, False), (58786, False, False), (42000, False, True), (61000, True, True)],
)
def test_looks_busy(free_mib: int, holders: bool, busy: bool) -> None:
    procs = parse_npu_processes(NPU_SMI_TABLE) if holders else ()
    assert looks_busy(64, free_mib, procs) is busy
