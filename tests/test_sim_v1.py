"""The emulated vLLM 0.24 server on the emulated H100 against the real H100 runs.

Every expected figure is parsed from the real logs and JSON files under
../shared/real-logs/vllm-0.24-h100/ (never restated here): outcome, KV figures within 1 %,
NVML peaks within 1 %. The in-process run replays all seven runs (G1: the MoE Qwen3-30B-A3B); the subprocess server replays
A2 (ready, 12 x 32k) and F (first 32k prefill OOMs -> HTTP 500) over real HTTP on port 0,
sampled by the in-process EmulatedReader every 20 ms like a tuner would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pretuner.devices.nvidia import parse_nvidia_smi_csv
from pretuner.models import resolve
from pretuner.sim.kvcache import cache_layout
from pretuner.sim.reader import EmulatedReader
from pretuner.sim.v1 import inproc
from pretuner.sim.v1.config import UsageError, batch_defaults, human_bytes, parse
from pretuner.sim.v1.http import DEAD_BODY, length_error
from pretuner.sim.v1.memory import CUDA_PROFILES, CudaProfile, perturbed
from pretuner.sim.v1.scheduler import Limits, Req, Scheduler
from pretuner.sim.v1.truth import max_kv_bytes, util_outcome
from pretuner.units import GIB
from tests.helpers import shared

REAL = shared("real-logs", "vllm-0.24-h100")
MOE = "G1-moe-util090"
RUNS = ("A2-util090", "B-util098", "C-kv59g", "E1-kv60g", "E2-kv61g", "F-kv59g-mbt32k", MOE)
ENV = {"PRETUNER_SIM_PROFILE": "h100-80", "PRETUNER_SIM_SEED": "0",
       "PRETUNER_SIM_OCCUPIED_MIB": "0", "PRETUNER_SIM_STARTUP_S": "0.02",
       "PRETUNER_SIM_TIME_SCALE": "0.01"}


@dataclass(frozen=True)
class Figures:
    """What a log says about the KV cache and how the run ended."""

    available_gib: float | None
    pinned_gib: float | None
    kv_tokens: int | None
    oom_alloc: str | None  # "Tried to allocate X" of the first OOM
    outcome: str  # "ready", "oom-start", "oom-first-prefill"


def figures(log: str, ready: bool) -> Figures:
    def num(pattern: str) -> str | None:
        m = re.search(pattern, log)
        return m.group(1) if m else None

    avail, pinned = num(r"Available KV cache memory: ([\d.]+) GiB"), num(r"reserved ([\d.]+) GiB")
    tokens = num(r"GPU KV cache size: ([\d,]+) tokens")
    alloc = num(r"Tried to allocate ([\d.]+ [GM]iB)")
    outcome = ("oom-start" if not ready else
               "oom-first-prefill" if "EngineCore encountered a fatal error" in log else "ready")
    return Figures(float(avail) if avail else None, float(pinned) if pinned else None,
                   int(tokens.replace(",", "")) if tokens else None, alloc, outcome)


def real(name: str) -> tuple[dict[str, Any], Figures]:
    data = json.loads((REAL / f"{name}.json").read_text(encoding="utf-8"))
    log = (REAL / f"{name}.log").read_text(encoding="utf-8")
    return data, figures(log, bool(data["ready"]))


@cache
def vllm_max_num_seqs() -> int:
    """The max-num-seqs every real run left at vLLM's default on this H100, as the README
    quotes the engine's own line; the emulator's default is not vLLM's yet."""
    text = (REAL.parent / "README.md").read_text(encoding="utf-8")
    return int(re.findall(r"warming up sampler with (\d+) dummy requests", text)[0])


def serve_args(data: dict[str, Any]) -> list[str]:
    """The real run's command line, as it ran: with vLLM's max-num-seqs."""
    cmd = data["cmd"]
    return [*cmd[cmd.index("serve") + 1:], "--max-num-seqs", str(vllm_max_num_seqs())]


def flag(data: dict[str, Any], name: str) -> str:
    return str(data["cmd"][data["cmd"].index(name) + 1])


def close(a: float | None, b: float | None, rel: float = 0.01) -> bool:
    return a is not None and b is not None and abs(a - b) <= rel * abs(b)


def assert_same_figures(mine: Figures, theirs: Figures) -> None:
    assert mine.outcome == theirs.outcome
    for field in ("available_gib", "pinned_gib", "kv_tokens"):
        expected = getattr(theirs, field)
        if expected is None:
            assert getattr(mine, field) is None, field
        else:
            assert close(getattr(mine, field), expected), field
    assert mine.oom_alloc == theirs.oom_alloc


# -- the six runs, in-process ---------------------------------------------------------------
@pytest.mark.parametrize("name", RUNS)
def test_inprocess_replays_the_real_run(name: str) -> None:
    data, theirs = real(name)
    load = data.get("load_over") or data.get("load_full") or {"seqs": 1, "prompt": 32736,
                                                               "decode": 32}
    res = inproc.run(serve_args(data), ENV, [load["prompt"]] * load["seqs"], load["decode"],
                     first=load["prompt"])
    assert res.ready == data["ready"]
    assert res.exit_code == (0 if data["ready"] else 1)
    assert res.total_mib == data["total_mib"]
    assert_same_figures(figures(res.log, res.ready), theirs)
    peaks = data["peaks_mib"]
    assert close(res.peaks_mib["start"], peaks["start"])
    if not data["ready"]:
        assert res.peaks_mib["stop"] == peaks["stop"]
        assert "Engine core initialization failed. See root cause above." in res.log
        return
    assert close(res.peaks_mib["probe"], peaks["probe"])
    assert close(res.peaks_mib["load"], peaks["load-full"])
    assert res.peaks_mib["load"] <= data["total_mib"]
    statuses = {r.status for r in res.replies}
    if theirs.outcome == "oom-first-prefill":
        assert statuses == {500}
        assert data["probe"]["status"] == 500
    else:
        assert statuses == {200}
        assert all(r.completion_tokens == load["decode"] for r in res.replies)


def test_non_kv_peak_is_the_same_in_every_ready_run() -> None:
    """The real ready runs peak ~20,040 MiB above their KV cache; so must the emulator."""
    for name in ("A2-util090", "C-kv59g", "E1-kv60g"):
        data, theirs = real(name)
        res = inproc.run(serve_args(data), ENV, [32736] * 4, 32, first=32736)
        kv_mib = (theirs.available_gib or theirs.pinned_gib or 0) * 1024
        real_gap = data["peaks_mib"]["probe"] - kv_mib
        assert abs(res.peaks_mib["probe"] - kv_mib - real_gap) < 60


# -- the subprocess server over HTTP ----------------------------------------------------------
class Running:
    """A real `python -m pretuner.sim vllm serve` on port 0, sampled every 20 ms."""

    def __init__(self, tmp: Path, args: list[str]) -> None:
        self.env = {**os.environ, **ENV, "PRETUNER_SIM_STATE_DIR": str(tmp / "state")}
        self.env.pop("CUDA_VISIBLE_DEVICES", None)
        self.log_path = tmp / "server.log"
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        reader = EmulatedReader(self.env, frozenset({0}))
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pretuner.sim", "vllm", "serve", *args, "--host",
                 "127.0.0.1", "--port", "0"], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self._sampler = threading.Thread(target=self._sample, args=(reader,), daemon=True)
        self._sampler.start()
        self.port = self._wait_ready()

    def _sample(self, reader: EmulatedReader) -> None:
        while not self._stop.wait(0.02):
            sample = reader.sample()
            if sample is not None:
                used = sample.worst_used_mib
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), used)

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            m = re.search(r"Starting vLLM server on http://127\.0\.0\.1:(\d+)", self.log())
            if m:
                return int(m.group(1))
            time.sleep(0.02)
        raise AssertionError("not ready: " + self.log()[-2000:])

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as err:
            return err.code

    def complete(self, prompt_len: int, max_tokens: int) -> tuple[int, dict[str, Any]]:
        body = json.dumps({"model": "m", "prompt": [7] * prompt_len, "max_tokens": max_tokens})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=body.encode(), method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def stop(self) -> int:
        self.phase = "stop"
        time.sleep(0.15)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=20)
        self._stop.set()
        self._sampler.join()
        return code


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    started: list[Running] = []

    def start(args: list[str]) -> Running:
        started.append(Running(tmp_path, args))
        return started[-1]

    yield start
    for r in started:
        if r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()


@pytest.mark.slow
def test_subprocess_a2_ready_then_twelve_32k_requests(launch: Any) -> None:
    data, theirs = real("A2-util090")
    srv = launch(serve_args(data))
    assert srv.get("/health") == 200
    csv = subprocess.run([sys.executable, "-m", "pretuner.sim", "nvidia-smi",
                          "--query-gpu=index,memory.used,memory.total",
                          "--format=csv,noheader,nounits"], env=srv.env, capture_output=True,
                         text=True, check=True).stdout
    gpus = parse_nvidia_smi_csv(csv)
    assert gpus[0].total_mib == data["total_mib"]
    assert close(gpus[0].used_mib, data["peaks_mib"]["start"])
    assert all(g.used_mib == CUDA_PROFILES["h100-80"].idle_mib for g in gpus[1:])
    load = data["load_full"]
    srv.phase = "probe"
    status, body = srv.complete(load["prompt"], load["decode"])
    assert status == 200
    assert body["usage"]["completion_tokens"] == load["decode"]
    srv.phase = "load-full"
    with ThreadPoolExecutor(load["seqs"]) as pool:
        got = list(pool.map(lambda _: srv.complete(load["prompt"], load["decode"]),
                            range(load["seqs"])))
    assert [s for s, _ in got] == [200] * load["seqs"]
    assert all(b["usage"]["prompt_tokens"] == load["prompt"] for _, b in got)
    assert srv.stop() == 0
    assert_same_figures(figures(srv.log(), True), theirs)
    for phase in ("start", "probe", "load-full"):
        assert close(srv.peaks[phase], data["peaks_mib"][phase]), phase
    assert not list((Path(srv.env["PRETUNER_SIM_STATE_DIR"])).glob("cuda-*"))
    assert '"POST /v1/completions HTTP/1.1" 200 OK' in srv.log()


@pytest.mark.slow
def test_subprocess_f_first_prefill_ooms_and_the_engine_stays_dead(launch: Any) -> None:
    data, theirs = real("F-kv59g-mbt32k")
    srv = launch(serve_args(data))
    srv.phase = "probe"
    status, body = srv.complete(32736, 32)
    assert status == 500
    assert body == json.loads(data["probe"]["body"]) == DEAD_BODY
    srv.phase = "load-full"
    assert srv.complete(1000, 8) == (500, DEAD_BODY)
    assert srv.get("/health") == 503
    assert srv.proc.poll() is None  # a dead engine, a live process
    assert srv.stop() == 0
    log = srv.log()
    assert_same_figures(figures(log, True), theirs)
    assert "[core.py:1233] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " \
           "1.50 GiB. GPU 0 has a total capacity of 79.18 GiB" in log
    assert close(srv.peaks["start"], data["peaks_mib"]["start"])
    assert close(srv.peaks["probe"], data["peaks_mib"]["probe"])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "alloc"), [("B-util098", "248.00 MiB"),
                                           ("E2-kv61g", "594.00 MiB")])
def test_subprocess_failed_start_is_seen_by_a_sampler_then_exits_1(tmp_path: Path, name: str,
                                                                    alloc: str) -> None:
    """The failing transient (graph capture, sampler warm-up) is held long enough for a
    20 ms sampler, then the process exits 1 and leaves no state behind."""
    data, _ = real(name)
    env = {**os.environ, **ENV, "PRETUNER_SIM_STATE_DIR": str(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    reader = EmulatedReader(env, frozenset({0}))
    log = tmp_path / "server.log"
    peak = 0
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pretuner.sim", "vllm", "serve",
                                 *serve_args(data)], env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            sample = reader.sample()
            peak = max(peak, sample.worst_used_mib if sample else 0)
            time.sleep(0.02)
    assert proc.wait(timeout=5) == 1
    text = log.read_text(encoding="utf-8")
    assert f"Tried to allocate {alloc}" in text
    assert "RuntimeError: Engine core initialization failed. See root cause above. Failed " \
           "core proc(s): {}" in text
    assert close(peak, data["peaks_mib"]["start"])
    assert not list(tmp_path.glob("cuda-*"))


# -- failures, arguments, scheduler, truth ---------------------------------------------------
BASE = ["qwen3-8b", "--max-model-len", "32768"]


def test_util_above_free_memory_refuses_at_start() -> None:
    res = inproc.run(BASE, {**ENV, "PRETUNER_SIM_OCCUPIED_MIB": "20000"}, [100], 4)
    assert not res.ready
    assert res.exit_code == 1
    assert "is less than desired GPU memory utilization (0.9," in res.log


def test_kv_too_small_for_one_sequence_names_the_estimated_length() -> None:
    res = inproc.run(["qwen3-8b", "--max-model-len", "40960", "--kv-cache-memory-bytes", "1G"],
                     ENV, [100], 4)
    assert not res.ready
    assert "the estimated maximum model length is 7280" in res.log


def test_no_kv_memory_at_all() -> None:
    res = inproc.run(BASE + ["--gpu-memory-utilization", "0.2"], ENV, [100], 4)
    assert not res.ready
    assert "No available memory for the cache blocks. Try increasing " \
           "`gpu_memory_utilization` when initializing the engine." in res.log


def test_enforce_eager_skips_graph_capture_and_frees_its_pool() -> None:
    eager = inproc.run(BASE + ["--enforce-eager"], ENV, [32736], 32)
    graphs = inproc.run(BASE, ENV, [32736], 32)
    assert "Graph capturing finished" not in eager.log
    assert "Graph capturing finished in 8 secs, took 1.01 GiB" in graphs.log
    assert eager.peaks_mib["load"] < graphs.peaks_mib["load"] - 1000


def test_too_long_requests_get_400_and_never_reach_the_engine() -> None:
    res = inproc.run(BASE, ENV, [32767, 32736], 32)
    assert [r.status for r in res.replies] == [400, 200]
    assert length_error(32768, 32736, 32) is None
    assert "maximum context length is 32768 tokens" in (length_error(32768, 40000, 1) or "")


def test_tensor_parallel_ranks_hold_half_the_weights() -> None:
    one = inproc.run(BASE, ENV, [1000], 4)
    two = inproc.run(BASE + ["-tp", "2"], ENV, [1000], 4)
    assert two.ready
    assert "Model loading took 7.64 GiB" in two.log
    assert "Model loading took 15.27 GiB" in one.log


def test_seeds_perturb_but_seed_zero_is_the_calibration() -> None:
    assert perturbed(0) == perturbed(0)
    assert perturbed(1) != perturbed(0)
    assert perturbed(1) == perturbed(1)


@pytest.mark.parametrize(("raw", "value"), [("60G", 64424509440), ("59G", 63350767616),
                                            ("1024", 1024), ("2M", 2 * 1024**2),
                                            ("1.5T", int(1.5 * 1024**4)), ("32k", 32000)])
def test_human_bytes(raw: str, value: int) -> None:
    assert human_bytes(raw) == value


def test_command_line_takes_vllm_flags_and_ignores_unknown_ones() -> None:
    cfg = parse(["--model", "qwen3-8b", "--max_model_len", "4096", "--trust-remote-code",
                 "--swap-space", "4", "-tp", "2"], {})
    assert (cfg.model, cfg.max_model_len, cfg.tp) == ("qwen3-8b", 4096, 2)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.util) == (1024, 8192, 0.9)
    assert "--trust-remote-code" in cfg.ignored
    with pytest.raises(UsageError):
        parse(["qwen3-8b"], {"PRETUNER_SIM_PROFILE": "910b-64"})


@pytest.mark.parametrize(("profile", "seqs", "batched"), [
    (CUDA_PROFILES["h100-80"], 1024, 8192),
    (CUDA_PROFILES["cuda-64"], 256, 2048),
    (CUDA_PROFILES["cuda-24"], 256, 2048),
    # At least 70 GiB but an A100: vLLM keeps the smaller batch (larger ones slow it down).
    (CUDA_PROFILES["a100-80"], 256, 2048),
])
def test_server_defaults_follow_vllms_rule_for_the_card(profile: CudaProfile, seqs: int,
                                                        batched: int) -> None:
    """Without --max-num-seqs / --max-num-batched-tokens the emulated server runs vLLM's
    OpenAI-server defaults for its card: 1024 / 8192 on a GPU of 70 GiB or more that is not
    an A100, 256 / 2048 otherwise; given flags win."""
    assert batch_defaults(profile, {}) == (seqs, batched)
    # The tests' knob narrows the default width only.
    assert batch_defaults(profile, {"PRETUNER_SIM_MAX_NUM_SEQS": "64"}) == (64, batched)
    if profile.name in CUDA_PROFILES:
        cfg = parse(["qwen3-8b"], {"PRETUNER_SIM_PROFILE": profile.name})
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (seqs, batched)
    cfg = parse(["qwen3-8b", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096"], {})
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (64, 4096)


def test_scheduler_chunks_queues_and_preempts_without_dropping() -> None:
    sched = Scheduler(Limits(max_num_seqs=4, max_num_batched_tokens=8192, block_size=16,
                             num_blocks=4200))  # 67,200 tokens: two 32k requests at most
    reqs = [Req(f"r{i}", 32736, 32) for i in range(5)]
    for r in reqs:
        sched.add(r)
    done: list[Req] = []
    for _ in range(100_000):
        if sched.idle:
            break
        plan = sched.plan()
        assert plan.tokens <= 8192
        done += sched.commit(plan)
    assert sorted(r.request_id for r in done) == [r.request_id for r in reqs]
    assert all(r.generated == 32 for r in reqs)


def test_truth_on_the_real_h100() -> None:
    spec = resolve("qwen3-8b")
    kw: dict[str, Any] = {"seed": 0, "max_model_len": 32768, "max_num_seqs": vllm_max_num_seqs(),
                          "max_num_batched_tokens": 8192}
    # The real card served its max-length load with 60 GiB pinned and died at start-up at 61.
    assert 60 * GIB <= max_kv_bytes(spec, "h100-80", burst=False, **kw) < 61 * GIB
    # A burst as wide as max-num-seqs samples 1024 rows at once: at least their fp32 logits
    # (1024 x 151,936 x 4 B = 593.5 MiB) more than the load's few rows need.
    best = max_kv_bytes(spec, "h100-80", **kw)
    assert 58 * GIB < best <= 61 * GIB - 1024 * spec.vocab_size * 4
    _, a2 = real("A2-util090")
    assert close(util_outcome(spec, "h100-80", util=0.9, load=False, **kw)[0] / GIB, a2.available_gib)
    assert util_outcome(spec, "h100-80", util=0.98, load=False, **kw)[0] == 0  # B: dies in graph capture


@pytest.mark.parametrize(("name", "model", "rel"), [("A2-util090", "qwen3-8b", 0.01),
                                                   (MOE, "qwen3-30b-a3b", 0.05)])
def test_util_090_gives_the_real_kv_tokens(name: str, model: str, rel: float) -> None:
    """Issue 27 item 8: at the real run's util, length and step budget (its log's), TP1, the
    emulated H100's KV tokens are the real ones: dense within 1 %, MoE within 5 % (its fused-MoE
    workspace, the V1 runner's sampler at max-num-seqs and graph estimate)."""
    data, theirs = real(name)
    log = (REAL / f"{name}.log").read_text(encoding="utf-8")
    batched = int(re.findall(r"max_num_batched_tokens=(\d+)", log)[0])
    spec = resolve(model)
    kv, _ = util_outcome(spec, "h100-80", util=float(flag(data, "--gpu-memory-utilization")),
                         seed=0, max_model_len=int(flag(data, "--max-model-len")),
                         max_num_seqs=vllm_max_num_seqs(), max_num_batched_tokens=batched,
                         load=False)
    assert theirs.kv_tokens == data["kv_tokens"]
    assert close(kv // cache_layout(spec).bytes_per_token, data["kv_tokens"], rel)


@pytest.mark.parametrize(("profile", "mml", "seed"), [("h100-80", 32768, 0), ("h100-80", 16384, 3),
                                                      ("cuda-32", 8192, 0)])
def test_truth_agrees_with_the_server(profile: str, mml: int, seed: int) -> None:
    """The truth's KV works under the worst-case load; 64 MiB more does not."""
    spec = resolve("qwen3-8b")
    best = max_kv_bytes(spec, profile, seed=seed, max_model_len=mml, max_num_seqs=256,
                        max_num_batched_tokens=8192)
    assert best > 0
    env = {**ENV, "PRETUNER_SIM_PROFILE": profile, "PRETUNER_SIM_SEED": str(seed)}
    outcomes = []
    for kv in (best, best + 64 * 2**20):
        argv = ["qwen3-8b", "--max-model-len", str(mml), "--kv-cache-memory-bytes", str(kv),
                "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]
        tokens = int(re.findall(r"GPU KV cache size: ([\d,]+)", inproc.run(argv, env, [], 1).log)
                     [0].replace(",", ""))
        count = max(1, min(256, tokens // mml))
        res = inproc.run(argv, env, [mml - 1] * count, 1, first=mml - 1)
        outcomes.append(res.ready and all(r.status == 200 for r in res.replies))
    assert outcomes == [True, False]


@pytest.mark.parametrize(("layers", "pp", "stage_layers"), [(61, 1, 61), (61, 2, 31), (61, 4, 16),
                                                            (60, 4, 15), (4, 4, 1)])
def test_the_busiest_pipeline_stage_has_the_leftover_layers(layers: int, pp: int,
                                                            stage_layers: int) -> None:
    """vLLM's get_pp_indices gives the layers left over to the earliest stages: the first
    stage, the one the emulator boots, holds ceil(layers / pp) and that share of the weights."""
    from dataclasses import replace

    from pretuner.sim.v1.boot import first_stage

    spec = replace(resolve("deepseek-v3"), num_layers=layers)
    stage, share = first_stage(spec, pp)
    assert (stage.num_layers, share) == (stage_layers, stage_layers / layers)


def test_more_stages_than_layers_is_refused_like_vllm() -> None:
    from dataclasses import replace

    from pretuner.sim.argv import Refused
    from pretuner.sim.v1.boot import first_stage

    with pytest.raises(Refused, match=r"layers \(4\) must be at least the pipeline parallel"):
        first_stage(replace(resolve("deepseek-v3"), num_layers=4), 8)
