"""The proof's wide short burst: max-num-seqs short requests at once, the widest batch a server
reaches, where the logits and the sampler's buffers (rows x vocabulary) peak.

The sizing rule is a table and a property; the emulated V1 engine's memory grows with the
batch width, so a burst too wide for the headroom runs out of memory there, the burst phase
catches it and the tuner backs off; the verdict names the phase that set the peak.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import BURST_PROMPT_TOKENS, Burst, burst_shape, peak_phase
from pretuner.engines.outcome import OutcomeKind as K
from pretuner.launch.images import TextRequest
from pretuner.sim.executor import v1_in_process
from pretuner.sim.inproc import InprocRun
from pretuner.sim.v1 import inproc
from pretuner.tune.entry import RunOptions
from pretuner.tune.pinned.loop import V1Tuner
from tests.helpers import V1_QWEN_80_32K, FinishedRun

H100_ENV = {"PRETUNER_SIM_PROFILE": "h100-80", "PRETUNER_SIM_SEED": "0",
            "PRETUNER_SIM_OCCUPIED_MIB": "0", "PRETUNER_SIM_STARTUP_S": "0.02",
            "PRETUNER_SIM_TIME_SCALE": "0.01"}
# Qwen3-8B at 32k on the emulated H100: what the proof without a burst pinned (59.68 GiB): its
# worst case and 13 concurrent max-length requests fit, 404 MiB left (tests/test_run_v1.py).
UNBURST_KV = 64_084_770_816


def shape(seqs: int = 1024, batched: int = 8192, mml: int = 32768, block: int = 16
          ) -> LaunchSettings:
    return LaunchSettings(Purpose.VALIDATE, 80, 0.9, 0, mml, seqs, batched, block, 1)


@pytest.mark.parametrize(("s", "kv_tokens", "out", "expected", "rule"), [
    (shape(), 434_592, 128, Burst(1024, 128, 128),
     "the H100 default: 1024 wide, 128 + 128 tokens; the prefill of all takes 16 steps"),
    (shape(), 434_592, 16, Burst(1024, 128, 32),
     "16 prefill steps of 8192 tokens: at least 32 tokens out, so that all decode together"),
    (shape(seqs=256), 434_592, 16, Burst(256, 128, 16),
     "prefill in 4 steps: 16 tokens out already overlap it twice"),
    (shape(seqs=1024, batched=1024), None, 16, Burst(1024, 128, 256),
     "a small step budget: 128 prefill steps, 256 tokens out so that all decode together"),
    (shape(seqs=512, batched=256), None, 16, Burst(256, 128, 256),
     "a decode step takes one token of each: no wider than max-num-batched-tokens"),
    (shape(), 16_384, 16, Burst(1024, 8, 8),
     "1024 blocks for 1024 requests: one block each, split between prompt and output"),
    (shape(), 1024, 16, Burst(64, 8, 8),
     "fewer blocks than max-num-seqs: one request per block, no preemption"),
    (shape(seqs=4, batched=2048, mml=1024), None, 4, Burst(4, 128, 4),
     "a CPU engine's few sequences: short, few tokens out"),
    (shape(seqs=8, mml=64), None, 16, Burst(8, 32, 16),
     "max_model_len 64: each request fits in it"),
])
def test_burst_sizing_rule(s: LaunchSettings, kv_tokens: int | None, out: int,
                           expected: Burst, rule: str) -> None:
    assert burst_shape(s, kv_tokens, out) == expected, rule


@given(seqs=st.integers(1, 4096), batched=st.integers(1, 65536),
       mml=st.integers(16, 262144), block=st.sampled_from([8, 16, 32, 64, 128]),
       kv_tokens=st.none() | st.integers(0, 2_000_000), out=st.integers(1, 256))
def test_a_burst_always_runs_at_once(seqs: int, batched: int, mml: int, block: int,
                                     kv_tokens: int | None, out: int) -> None:
    """Whatever the shape: every request fits max_model_len and its share of the KV cache in
    whole blocks (none is preempted), the batch is as wide as max-num-seqs unless the step
    budget or the blocks forbid it, and the output outlasts the prefill where room allows."""
    s = shape(seqs, batched, mml, block)
    b = burst_shape(s, kv_tokens, out)
    assert min(b.requests, b.prompt_len, b.max_tokens) >= 1
    assert b.prompt_len + b.max_tokens <= mml
    assert b.prompt_len <= BURST_PROMPT_TOKENS
    width = min(seqs, batched)
    if kv_tokens is None:
        assert b.requests == width
        return
    blocks = max(1, kv_tokens // block)
    assert b.requests == min(width, blocks)
    each = -(-(b.prompt_len + b.max_tokens) // block)
    assert b.requests * each <= blocks
    steps = -(-b.requests * b.prompt_len // batched)
    room = min(mml, blocks // b.requests * block)
    assert b.max_tokens >= min(room - b.prompt_len, max(out, 2 * steps))


def test_peak_phase_is_the_first_phase_to_reach_the_peak() -> None:
    """The device's level only grows while torch keeps its cache: later phases repeat the
    peak; the one that set it is the first to reach it."""
    assert peak_phase({"loading": 80_283, "worst": 81_149, "load": 81_153, "burst": 81_378,
                       "stop": 81_378}) == "burst"
    assert peak_phase({"loading": 80_000, "load": 80_000}) == "loading"
    assert peak_phase({}) is None


def _burst_run(seqs: int) -> InprocRun:
    argv = ["qwen3-8b", "--max-model-len", "32768", "--max-num-seqs", str(seqs),
            "--max-num-batched-tokens", "8192", "--kv-cache-memory-bytes", str(UNBURST_KV)]
    return inproc.run(argv, H100_ENV, [32752] * 13, 16, first=32752,
                      burst=(TextRequest(128, 128),) * seqs)


def test_the_emulated_engine_runs_out_of_memory_in_a_burst_too_wide_for_the_headroom() -> None:
    """The emulated V1 engine's logits and sampler grow with the sequences sampled at once:
    the same pinned KV that serves the max-length load OOMs in a 1024-wide short burst, and
    serves a 64-wide one."""
    wide = _burst_run(1024)
    replies = [r.status for r in wide.replies]
    assert replies[:14] == [200] * 14  # the worst case and the max-length load were served
    assert 200 not in replies[14:]  # the engine died in the burst
    assert "CUDA out of memory" in wide.log
    assert set(wide.peaks_mib) >= {"probe", "load", "burst"}
    narrow = _burst_run(64)
    assert [r.status for r in narrow.replies] == [200] * (14 + 64)
    assert narrow.peaks_mib["burst"] < wide.peaks_mib["burst"]


def test_a_burst_oom_is_caught_by_the_burst_phase_and_the_tuner_backs_off(
        tmp_path: Path) -> None:
    """The pinned KV a proof without a burst accepted: the burst phase runs out of memory
    after the max-length load was served, the tuner backs off, and the configuration it ends
    with is proven with the burst, which set its peak."""
    opts = RunOptions(model="qwen3-8b", engine="vllm", emulate=True, card_gib=80,
                      max_model_len=32768)
    cfg, execute = v1_in_process(opts, tmp_path)
    tuner = V1Tuner(cfg, execute, lambda p, d: None)
    r = tuner.validate(tuner.settings(Purpose.VALIDATE, cfg.util, UNBURST_KV))
    first = r.outcomes[0]
    assert first.kind is K.OOM_IN_REQUEST
    assert first.requests_ok == 14 < first.requests_total  # worst + 13 served, burst failed
    assert "burst" in first.device_peaks_mib
    assert [d["decision"] for d in r.decisions][:1] == ["back off"]
    assert r.validated
    assert (r.final.kv_cache_bytes or UNBURST_KV) < UNBURST_KV
    proof = r.outcomes[-1]
    assert proof.kind is K.OK
    assert peak_phase(proof.device_peaks_mib) == "burst"


@pytest.mark.slow
def test_the_emulated_h100_run_proves_a_1024_wide_burst_and_names_its_peak_phase(
        finished_run: Callable[..., FinishedRun]) -> None:
    """`run --model qwen3-8b --engine vllm --emulate --card 80 --max-model-len 32K`: the
    engine's default max-num-seqs there, 1024, proven by a burst that wide; the verdict names
    the phase that set the peak, in report.json, report.md and report.html."""
    run = finished_run(*V1_QWEN_80_32K)
    assert run.proc.returncode == 0, run.proc.stderr
    rep = json.loads(run.proc.stdout)
    assert rep["validated"]
    assert rep["final"]["max_num_seqs"] == 1024
    assert "1,024 concurrent short requests" in run.proc.stderr
    peak = rep["peak"]
    proof = next(s for s in rep["steps"] if s["n"] == peak["launch"])
    assert list(proof["device_peaks_mib"])[-3:-1] == ["load", "burst"]
    assert peak["peak_mib"] == max(proof["device_peaks_mib"].values())
    # Over HTTP at the tests' time scale the burst reaches the server over about a second
    # while its steps take under a millisecond: it never runs 1024 wide at once here, so the
    # phase named is whichever reached the peak first (the in-process tests run it full width).
    assert peak["phase"] == peak_phase(proof["device_peaks_mib"])
    md = (run.folder / "report.md").read_text("utf-8")
    assert f"set by {peak['what']} in launch {peak['launch']}" in md
    assert "peak set by" in (run.folder / "report.html").read_text("utf-8")
