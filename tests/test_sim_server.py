"""The emulated server as a real subprocess: real ports, HTTP, signals, exit codes and log text."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest
import requests

from pretuner import method
from pretuner.devices.npu_smi import parse_npu_smi
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import resolve
from tests.helpers import default_sigint

MODEL = "qwen3-8b"  # 16 GB bf16: fits one 64 GB card at TP1
PEAK_RE = re.compile(r"actual peak used mem:(\d+)M")
READY_RE = re.compile(r"Uvicorn running on http://[\d.]+:(\d+)")
FAST = ["--sim-startup-s", "0.1", "--sim-teardown-s", "0.1"]
PRERUN = ["--max-model-len", "16384", "--max-num-seqs", "1", "--max-num-batched-tokens", "16384",
          "--gpu-memory-utilization", "0.9"]
PRERUN_ENV = {"GLOG_v": "1", "ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "50"}


def _group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group (orphans may never be reaped here)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class Sim:
    """One emulated server (or launcher) process in its own session, logging to a file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY_RE.search(self.log)
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log[-3000:]}")

    def wait_exit(self, timeout: float = 15) -> int:
        return self.proc.wait(timeout=timeout)

    def stop_group(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        """Signal the whole process group and wait for every member, not only the leader."""
        os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while _group_alive(self.proc.pid):
            assert time.monotonic() < deadline, "process group still alive"
            time.sleep(0.05)

    def complete(self, prompt: object, max_tokens: int = 1, **extra: object) -> requests.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
        return requests.post(f"{self.url}/v1/completions", json=body, timeout=60)


class StartSim(Protocol):
    """The `sim` fixture: starts one more emulated server (or launcher) process."""

    def __call__(self, *args: str, env: dict[str, str] | None = None, seed: int = 0,
                 launcher: bool = False, name: str = "server") -> Sim: ...


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[StartSim]:
    started: list[Sim] = []

    def start(*args: str, env: dict[str, str] | None = None, seed: int = 0,
              launcher: bool = False, name: str = "server") -> Sim:
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("GLOG_", "ASCEND_", "vLLM_", "PRETUNER_SIM_"))}
        full_env["PRETUNER_SIM_STATE_DIR"] = str(tmp_path / "state")
        full_env["PRETUNER_SIM_SEED"] = str(seed)
        full_env.update(env or {})
        log_path = tmp_path / f"{name}-{len(started)}.log"
        cmd = [sys.executable, "-m", "pretuner.sim", "launch" if launcher else "serve",
               "--model", MODEL, "--host", "127.0.0.1", "--port", "0", *FAST, *args]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, preexec_fn=default_sigint)
        s = Sim(proc, log_path)
        started.append(s)
        return s

    yield start
    for s in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=10)


def run_to_exit(sim: StartSim, *args: str, env: dict[str, str]) -> tuple[int, str]:
    s = sim(*args, env=env)
    code = s.wait_exit()
    return code, s.log


# -- the seed's manual method, by hand --------------------------------------------------------


def prerun_peak(sim: StartSim, seed: int) -> tuple[int, str]:
    """Start with the seed's pre-run settings, send 16,384 tokens, SIGTERM, grep the worst rank."""
    s = sim(*PRERUN, env=PRERUN_ENV, seed=seed)
    s.wait_ready()
    too_long = s.complete(list(range(16384)), max_tokens=1)
    assert too_long.status_code == 400
    assert "maximum context length is 16384 tokens" in too_long.json()["message"]
    ok = s.complete(list(range(16383)), max_tokens=1)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == 16383
    assert "actual peak used" not in s.log  # never per request
    s.stop_group(signal.SIGTERM)
    assert s.proc.returncode == 0
    peaks = [int(p) for p in PEAK_RE.findall(s.log)]
    assert len(peaks) == 1
    return max(peaks), s.log


def full_load(s: Sim, seqs: int, max_model_len: int) -> list[int]:
    """max-num-seqs concurrent max-length requests; -1 for a refused or reset connection."""
    prompt = list(range(max_model_len - 1))

    def one() -> int:
        try:
            return s.complete(prompt, 1).status_code
        except requests.ConnectionError:
            return -1

    with ThreadPoolExecutor(max_workers=seqs) as pool:
        return list(pool.map(lambda _: one(), range(seqs)))


def final_args(final: method.FinalConfig) -> tuple[list[str], dict[str, str]]:
    flags = final.flags
    args: list[str] = []
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    env = {"GLOG_v": "1", **final.env}
    return args, env


@pytest.mark.slow
def test_manual_method_then_full_load_is_safe_and_10pct_less_headroom_ooms(
    sim: StartSim, tmp_path: Path
) -> None:
    bpt = kv_bytes_per_token(resolve(MODEL))
    ooms = []
    for seed in (1, 2):
        peak, _ = prerun_peak(sim, seed)
        d = method.derive(method.PrerunInputs(
            card_gib=64, util=0.9, model_use_gib=50, actual_peak_mib=peak,
            kv_bytes_per_token=bpt, block_size=16, max_model_len=16384))
        args, env = final_args(d.final)
        truth = tmp_path / f"truth-{seed}.json"
        s = sim(*args, "--sim-truth", str(truth), env=env, seed=seed)
        s.wait_ready()
        seqs = d.final.max_num_seqs
        assert seqs >= 10
        codes = full_load(s, seqs, 16384)
        assert codes == [200] * seqs, s.log[-2000:]
        s.stop_group()
        assert s.proc.returncode == 0
        assert "isn't enough" not in s.log
        t = json.loads(truth.read_text())
        assert t["kv_bytes_allocated"] <= t["safe_kv_bytes_in_pool"]

        # The same derivation with 10% less headroom: the non-KV budget (weights+activations
        # + headroom, before rounding up) cut by 10%; the KV cache gets the difference.
        tight = dict(env)
        tight["vLLM_MODEL_MEMORY_USE_GB"] = str(math.ceil(d.model_use_exact_gib * 0.9))
        tight_truth = tmp_path / f"tight-{seed}.json"
        bad = sim(*args, "--sim-truth", str(tight_truth), env=tight,
                  seed=seed)
        deadline = time.monotonic() + 15
        while not READY_RE.search(bad.log) and bad.proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if bad.proc.poll() is None:
            bad.wait_ready()
            full_load(bad, seqs, 16384)
            bad.wait_exit()
        oom = "memory isn't enough and alloc failed" in bad.log
        ooms.append(oom)
        if oom:
            t = json.loads(tight_truth.read_text())
            assert t["kv_bytes_allocated"] > t["safe_kv_bytes_in_pool"]
    assert any(ooms)


# -- failure modes -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "args", "text"),
    [
        ({"ASCEND_TOTAL_MEMORY_GB": "64.5", "vLLM_MODEL_MEMORY_USE_GB": "50"}, [],
         "ValueError: invalid literal for int() with base 10: '64.5'"),
        ({"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "50.5"}, [],
         "ValueError: invalid literal for int() with base 10: '50.5'"),
        ({"vLLM_MODEL_MEMORY_USE_GB": "50"}, ["--gpu-memory-utilization", "0.95"],
         "The Free Device Memory Size is 60.0166 GB, max_device_memory should be in range "
         "(0-61457]MB, but got 62259.2MB"),
        ({"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "58"}, [],
         "ValueError: No available memory for the cache blocks. Try increasing "
         "`gpu_memory_utilization` when initializing the engine."),
        ({"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "57"},
         ["--max-model-len", "16384"],
         "ValueError: The model's max seq len (16384) is larger than the maximum number of "
         "tokens that can be stored in KV cache (4368)."),
        ({"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "10", "GLOG_v": "1"},
         ["--max-model-len", "4096"],
         "memory isn't enough and alloc failed, kernel name: kv_cache"),
        ({"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "17"},
         ["--max-model-len", "16384"],
         "memory isn't enough and alloc failed, kernel name: Default/model-LlamaModel/layers-"
         "CellList/0-DecoderLayer/attention-Attention/FlashAttentionScore-op0"),
    ],
    ids=["total-not-int", "model-use-not-int", "util-over-free", "no-kv-blocks",
         "max-len-over-kv", "oom-kv-alloc", "oom-warmup"],
)
def test_startup_failures(sim: StartSim, env: dict[str, str], args: list[str], text: str) -> None:
    code, log = run_to_exit(sim, *args, env=env)
    assert code == 1
    assert text in log
    assert "Uvicorn running" not in log
    if "ASCEND_TOTAL_MEMORY_GB" not in env:
        assert "Total device memory should be set by environ 'ASCEND_TOTAL_MEMORY_GB'" in log


def test_weights_oom_at_start_dumps_pool(sim: StartSim) -> None:
    s = sim("--model", "qwen3-32b", "--max-model-len", "4096", env={
        "ASCEND_TOTAL_MEMORY_GB": "32", "vLLM_MODEL_MEMORY_USE_GB": "20", "GLOG_v": "1",
        "PRETUNER_SIM_PROFILE": "910b-32"})
    assert s.wait_exit() == 1
    assert "#umsg#Memory not enough:#umsg#Device(id:0) memory isn't enough" in s.log
    assert "Gather-op0" in s.log  # during weight loading, before any KV
    assert PEAK_RE.search(s.log)


@pytest.mark.slow
def test_oom_during_request_gives_500_and_kills_the_server(sim: StartSim) -> None:
    # 18 GiB holds the weights and the 8k warm-up but not a 16k prefill.
    s = sim("--max-model-len", "16384", "--max-num-seqs", "1", env={
        "ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "18", "GLOG_v": "1"})
    s.wait_ready()
    assert requests.get(f"{s.url}/health", timeout=5).status_code == 200
    small = s.complete(list(range(1000)), max_tokens=2)
    assert small.status_code == 200
    r = s.complete(list(range(16383)), max_tokens=1)
    assert r.status_code == 500
    assert s.wait_exit() == 1
    log = s.log
    assert re.search(r"\[ERROR\] DEVICE\(\d+,[0-9a-f]+,python\):.*#umsg#Memory not enough:#umsg#"
                     r"Device\(id:0\) memory isn't enough and alloc failed, kernel name: \S+, "
                     r"alloc size: \d+B\.", log)
    assert len(PEAK_RE.findall(log)) == 1  # dumped at the failed allocation, not again at exit
    assert "AsyncLLMEngine has failed, terminating server process" in log


@pytest.mark.slow
def test_sigkill_prints_nothing_and_glog_hides_info(sim: StartSim) -> None:
    quiet = sim(*PRERUN, env={"ASCEND_TOTAL_MEMORY_GB": "64",
                              "vLLM_MODEL_MEMORY_USE_GB": "50", "ASCEND_RT_VISIBLE_DEVICES": "1"})
    killed = sim(*PRERUN, env=PRERUN_ENV)
    quiet.wait_ready()
    killed.wait_ready()
    assert killed.complete(list(range(100))).status_code == 200
    killed.stop_group(signal.SIGKILL)
    quiet.stop_group(signal.SIGINT)
    assert quiet.proc.returncode == 0
    assert "actual peak used" not in killed.log
    assert "actual peak used" not in quiet.log  # GLOG_v unset: INFO lines hidden
    assert "Finished server process" in quiet.log


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_api_models_stream_text_and_unknown_flags(sim: StartSim) -> None:
    port = _free_port()
    s = sim("--max_model_len", "4096", "--enforce-eager", "--swap-space", "4",
            "--port", str(port), "--sim-startup-s", "0.8",
            "--served-model-name", MODEL, "other-name", "--trust-remote-code",
            "--distributed-executor-backend", "mp", "--tensor-parallel-size", "1",
            env={"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "40"})
    time.sleep(0.3)
    assert not READY_RE.search(s.log)
    with pytest.raises(requests.ConnectionError):  # the socket opens only when ready
        requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    s.wait_ready()
    assert s.port == port
    assert requests.get(f"{s.url}/health", timeout=5).status_code == 200
    models = requests.get(f"{s.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL, "other-name"]
    assert models["data"][0]["max_model_len"] == 4096
    text = s.complete("hello " * 40, max_tokens=3)
    assert text.status_code == 200
    assert text.json()["usage"]["completion_tokens"] == 3
    assert s.complete("x" * 20000, max_tokens=16).status_code == 400
    with requests.post(f"{s.url}/v1/completions", stream=True, timeout=30,
                       json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                             "stream": True}) as r:
        events = [ln for ln in r.iter_lines() if ln]
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 5
    wrong = requests.post(f"{s.url}/v1/completions", timeout=5,
                          json={"model": "nope", "prompt": [1], "max_tokens": 1})
    assert wrong.status_code == 404
    s.stop_group()


@pytest.mark.slow
def test_tp_across_nodes_writes_rank_logs_per_node(sim: StartSim, tmp_path: Path) -> None:
    logs = tmp_path / "glog"
    s = sim("--tensor-parallel-size", "4", "--sim-nodes", "2",
            "--max-model-len", "8192", "--sim-pool-format", "2.6",
            env={"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "30",
                 "GLOG_v": "1", "GLOG_logtostderr": "0", "GLOG_log_dir": str(logs),
                 "ASCEND_RT_VISIBLE_DEVICES": "0,1"})
    s.wait_ready()
    assert s.complete(list(range(8000))).status_code == 200
    s.stop_group()
    assert "actual peak used" not in s.log  # C++ lines went to the files
    peaks = {}
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        for rank in ranks:
            d = logs / f"node{node}" / f"rank_{rank}" / "logs"
            link = d / "mindspore.INFO"
            assert link.is_symlink()
            text = link.read_text()
            assert "The dynamic memory pool[DefaultAscendMemoryPool] stat info" in text
            m = re.search(r"\[INFO\] PRE_ACT\((\d+),[0-9a-f]+,python\):", text)
            assert m
            peaks[rank] = (int(m.group(1)), int(PEAK_RE.findall(text)[0]))
            assert list(d.glob("mindspore.log.*"))
    assert len({pid for pid, _ in peaks.values()}) == 4  # one pid per rank
    assert len({peak for _, peak in peaks.values()}) > 1  # ranks differ slightly


# -- the r0.1 launcher trap --------------------------------------------------------------------


@pytest.mark.slow
def test_launcher_sigint_loses_the_dump_sigterm_to_group_keeps_it(sim: StartSim) -> None:
    env = {**PRERUN_ENV, "PRETUNER_SIM_TEARDOWN_S": "0.6"}
    lost = sim(*PRERUN, "--sim-teardown-s", "0.6", env=env, launcher=True)
    env["ASCEND_RT_VISIBLE_DEVICES"] = "1"
    kept = sim(*PRERUN, "--sim-teardown-s", "0.6", env=env, launcher=True)
    lost.wait_ready()
    kept.wait_ready()
    for s in (lost, kept):
        assert s.complete(list(range(16383))).status_code == 200
    os.killpg(lost.proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group
    lost.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _group_alive(lost.proc.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    kept.stop_group(signal.SIGTERM)
    assert "actual peak used" not in lost.log
    assert "KeyboardInterrupt" in lost.log
    assert len(PEAK_RE.findall(kept.log)) == 1
    assert kept.proc.returncode == -signal.SIGTERM  # the wrapper's status says nothing


# -- npu-smi -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_npu_smi_shows_the_running_server(sim: StartSim, tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRETUNER_SIM_")}
    env["PRETUNER_SIM_STATE_DIR"] = str(state)
    shim_dir = tmp_path / "bin"
    out = subprocess.run([sys.executable, "-m", "pretuner", "sim", "install-shim", str(shim_dir)],
                         capture_output=True, text=True, check=True, env=env, timeout=30)
    assert out.stdout.strip() == str(shim_dir / "npu-smi")
    env["PATH"] = f"{shim_dir}{os.pathsep}{env['PATH']}"

    def hbm() -> list[tuple[int, int]]:
        text = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, check=True,
                              env=env, timeout=30).stdout
        rows = [ln for ln in text.splitlines() if "0000:" in ln]
        pairs = [re.findall(r"(\d+)\s*/\s*(\d+)", r)[-1] for r in rows]
        return [(int(used), int(total)) for used, total in pairs]

    idle = hbm()
    assert len(idle) == 8
    assert idle[0] == (3379, 65536)
    s = sim(env={"ASCEND_TOTAL_MEMORY_GB": "64",
                 "vLLM_MODEL_MEMORY_USE_GB": "50", "ASCEND_RT_VISIBLE_DEVICES": "3"})
    s.wait_ready()
    busy = hbm()
    assert busy[3] == (3379 + 700 + 58982, 65536)
    assert busy[0] == (3379, 65536)
    second = sim(env={"ASCEND_TOTAL_MEMORY_GB": "64",
                      "vLLM_MODEL_MEMORY_USE_GB": "50", "ASCEND_RT_VISIBLE_DEVICES": "3"})
    assert second.wait_exit() == 1
    assert "free memory size is less than half of total memory size" in second.log
    assert "may be other processes occupying this card" in second.log
    s.stop_group()
    assert hbm()[3] == (3379, 65536)


@pytest.mark.slow
def test_prompt_inside_the_watermark_is_dropped_with_an_empty_200(sim: StartSim) -> None:
    # 0.9 x 64 GiB - 55 GiB = 2.6 GiB of KV = 1,183 blocks of 16 x 147,456 B: a 16,383-token
    # prompt needs 1,024 of them beside the 1 % watermark (11). At util 0.8947 the cache has
    # 1,028 blocks: the prompt fits it, but would leave 4 < 10 watermark blocks: never admitted.
    for util, dropped in (("0.9", False), ("0.8947", True)):
        env = {**PRERUN_ENV, "vLLM_MODEL_MEMORY_USE_GB": "55"}
        s = sim(*PRERUN, "--gpu-memory-utilization", util, env=env)
        s.wait_ready()
        r = s.complete(list(range(16383)), max_tokens=1)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == (0 if dropped else 1)
        warned = "Input prompt (16383 tokens) is too long and exceeds the capacity of block_manager"
        assert (warned in s.log) is dropped
        s.stop_group(signal.SIGTERM)


@pytest.mark.slow
def test_chunked_prefill_is_on_by_default_above_32k(sim: StartSim) -> None:
    env = {**PRERUN_ENV, "vLLM_MODEL_MEMORY_USE_GB": "40"}
    s = sim("--max-model-len", "40960", "--max-num-seqs", "1", env=env)
    s.wait_ready()
    assert "Chunked prefill is enabled with max_num_batched_tokens=2048." in s.log
    r = s.complete(list(range(40000)), max_tokens=1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    s.stop_group(signal.SIGTERM)


def test_another_tenant_takes_free_memory_and_shows_in_npu_smi(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRETUNER_SIM_")}
    env.update(PRETUNER_SIM_OCCUPIED_MIB="20000", PRETUNER_SIM_STATE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pretuner.sim", "npu-smi", "info"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "23379/ 65536" in out
    assert "| 4242" in out

    assert parse_npu_smi(out)[0].hbm_used_mib == 23379
