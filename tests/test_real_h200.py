"""Real vLLM 0.24 on an H200 (`tests/fixtures/real/vllm-0.24-h200`): what `pretuner run`
wrote there, read back. The log reader, `analyze` and the run agree on every figure."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from pretuner.analyze.v1 import read_memory_series
from pretuner.engines.v1_launch import read_log
from pretuner.launch import probe
from pretuner.launch.images import TextRequest
from pretuner.sim.inproc import InprocRun
from pretuner.sim.v1 import inproc
from pretuner.units import MIB
from tests.helpers import invoke, run_cli

H200 = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200"
QWEN3_8B_BPT = 147_456  # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B


def report(run: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((H200 / run / "report.json").read_text("utf-8"))
    return data


@pytest.mark.parametrize("run", ["run32k", "run8k"])
def test_the_logs_say_what_the_run_recorded(run: str) -> None:
    rep = report(run)
    prerun, validate = (read_log(H200 / run / f"launch-{n}" / "server.log") for n in (1, 2))
    assert prerun.kv_tokens == rep["baseline"]["kv_tokens"] == 794_016
    assert prerun.kv_gib == pytest.approx(109.04)
    assert prerun.weights_gib == pytest.approx(15.27)
    assert validate.kv_tokens == rep["final"]["kv_tokens"] == 882_992
    assert not prerun.failed_oom
    assert not validate.failed_oom
    # The validation held the pinned bytes: whole blocks of 16 tokens of them.
    pinned = rep["final"]["kv_cache_memory_bytes"]
    assert validate.kv_tokens == pinned // (QWEN3_8B_BPT * 16) * 16


@pytest.mark.parametrize("run", ["run32k", "run8k"])
def test_the_series_peaks_are_the_recorded_ones(run: str) -> None:
    rep = report(run)
    series = [read_memory_series((H200 / run / f"launch-{n}" / "memory.tsv").read_text("utf-8"),
                                 f"launch-{n}") for n in (1, 2)]
    assert all(s.source == "nvml" and s.total_mib == 143_771 for s in series)
    assert series[0].peak_mib == rep["derivation"]["device_peak_mib"] == 130_539
    # Proven: the worst case ran under the pinned KV within the device, 676 MiB spare.
    total = series[1].total_mib
    assert total is not None
    assert series[1].peak_mib == 143_095 < total
    steps = rep["steps"]
    assert [s["outcome"] for s in steps] == ["ok", "ok"]


def test_the_derivation_adds_up() -> None:
    d = report("run32k")["derivation"]
    assert d["held_kv_mib"] == 794_016 * QWEN3_8B_BPT / MIB
    assert d["non_kv_peak_mib"] == d["device_peak_mib"] - d["held_kv_mib"]
    assert d["pinned_kv_mib"] == int(d["device_total_mib"] - d["non_kv_peak_mib"]
                                     - d["margin_mib"])
    assert report("run32k")["final"]["kv_cache_memory_bytes"] == d["pinned_kv_mib"] * MIB


def test_analyze_reads_the_runs_own_series_and_derives_the_same_pinned_kv() -> None:
    launch = H200 / "run32k" / "launch-1"
    done = invoke("analyze", str(launch / "server.log"), "--memory-series",
                  str(launch / "memory.tsv"), "-m", "qwen3-8b", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["budget"]["kv_bytes"] == report("run32k")["final"]["kv_cache_memory_bytes"]
    assert data["total_mib"] == 143_771
    assert "nvml series" in data["provenance"]["device_peak_mib"]


def test_a_real_device_is_named_by_its_measured_total() -> None:
    # The H200's 143,771 MiB, not "140 GB" (its GiB, floored, under the wrong unit).
    from pretuner.report.records import device_words, read_report

    rep = read_report(H200 / "run32k")  # a report.json of schema 1: it still reads
    assert device_words(rep) == "143,771 MiB device(s) (measured)"


@pytest.mark.slow
def test_the_readme_example_reproduces_on_the_emulated_h200(tmp_path: Path) -> None:
    # The README's real-GPU example run on the emulated H200 (`--card 141`; max-num-seqs 256 as
    # the real run was told): the card is named, its NVML total is the real one, and the
    # engine's profile and the proven pinned KV land within 1 % and 2 % of the real card's.
    done = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "141",
                   "--max-model-len", "32768", "--max-num-seqs", "256", "--json",
                   "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    emulated, real = json.loads(done.stdout), report("run32k")
    assert emulated["card_source"] == "emulated H200 141 GB"
    assert "emulated H200 141 GB device(s)" in (tmp_path / "run" / "report.md").read_text()
    assert emulated["derivation"]["budget"]["device_total_mib"] == 143_771
    assert real["derivation"]["device_total_mib"] == 143_771
    assert emulated["derivation"]["baseline"]["kv_tokens"] == pytest.approx(
        real["baseline"]["kv_tokens"], rel=0.01)
    assert emulated["final"]["kv_tokens"] == pytest.approx(real["final"]["kv_tokens"], rel=0.02)


BURST = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200-burst"


def burst_boots(case: str) -> list[dict[str, Any]]:
    lines = (BURST / case / "burst_spread.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines]


def test_the_sampler_warm_up_oom_is_read_as_a_start_up_oom() -> None:
    # The KV proven at 256 sequences, started at 1,024: the engine dies in its sampler warm-up
    # (1,024 x 151,936 x 4 B of fp32 logits), after the KV cache and the CUDA graphs.
    log = read_log(BURST / "oom-at-start" / "boot-1.log")
    assert log.failed_oom
    assert log.kv_tokens == 882_992
    assert log.oom_alloc_bytes == 594 * MIB
    assert log.graphs_gib == pytest.approx(1.00)
    assert not log.ready
    assert all(b.get("died_at_start") == 1 for b in burst_boots("oom-at-start"))


def test_analyze_backs_off_a_real_start_up_oom_to_a_kv_that_started_and_held(
        tmp_path: Path) -> None:
    # The back-off analyze advises from the failed boot must not exceed 123,000 MiB, the KV
    # measured on the same card to start, hold the proof and hold two 1,024-wide bursts.
    done = invoke("analyze", str(BURST / "oom-at-start" / "boot-1.log"), "-m", "qwen3-8b",
                  "--json")
    assert done.returncode == 0, done.stderr
    advised = json.loads(done.stdout)["back_off"]["kv_bytes"]
    held = burst_boots("kv-123000")
    assert all(b[p]["failed"] == 0 for b in held for p in ("proof", "burst1", "burst2"))
    assert advised <= int(held[0]["argv"][held[0]["argv"].index("--kv-cache-memory-bytes") + 1])


H200_ENV = {"PRETUNER_SIM_PROFILE": "h200-141", "PRETUNER_SIM_SEED": "0",
            "PRETUNER_SIM_OCCUPIED_MIB": "0", "PRETUNER_SIM_STARTUP_S": "0.02",
            "PRETUNER_SIM_TIME_SCALE": "0.01"}


def emulated_boot(case: str, proof: bool) -> InprocRun:
    """The real boot's flags on the emulated H200, in-process; the proof load and the burst
    when asked."""
    argv = burst_boots(case)[0]["argv"]
    args = ["qwen3-8b", *argv[argv.index("--kv-cache-memory-bytes"):]]
    prompt = probe.max_length_prompt_len(32_768, 32)
    burst = (TextRequest(128, 128),) * 1024 if proof else ()
    return inproc.run(args, H200_ENV, [prompt] * 26 if proof else [1], 32, first=prompt,
                      burst=burst)


def test_the_emulated_h200_dies_where_the_real_one_did() -> None:
    # The real log: 594.00 MiB asked in the sampler warm-up, 447.12 MiB free. The emulator's
    # own model of the engine must fail the same way, within 20 MiB of the same free memory.
    res = emulated_boot("oom-at-start", proof=False)
    assert not res.ready
    real_log = (BURST / "oom-at-start" / "boot-1.log").read_text("utf-8")
    free = [float(m) for m in re.findall(r"of which ([\d.]+) MiB is free", real_log + res.log)]
    assert "Tried to allocate 594.00 MiB" in res.log
    assert free[0] == 447.12
    assert abs(free[-1] - free[0]) <= 20


def test_the_emulated_h200_starts_and_holds_where_the_real_one_did() -> None:
    # 123,000 MiB pinned: the real card was ready at 142,997 / 142,973 MiB and peaked at
    # 143,191 / 143,165 MiB under one 32k request then 26 at once (two boots).
    res = emulated_boot("kv-123000", proof=True)
    real = burst_boots("kv-123000")
    assert res.ready
    assert {r.status for r in res.replies} == {200}
    assert res.peaks_mib["start"] == pytest.approx(
        statistics.mean(b["idle_mib"] for b in real), abs=100)
    assert res.peaks_mib["load"] == pytest.approx(
        statistics.mean(b["proof"]["peak_mib"] for b in real), abs=100)
    assert res.peaks_mib["load"] < real[0]["total_mib"] == res.total_mib
    # Then 1,024 short requests at once: the real card served them, 476 MiB above the proof's
    # peak in its worse boot (4 MiB in the other); the emulated one serves them too, within
    # 50 MiB of the worse boot's rise and below the device total.
    rise = max(b["burst1"]["peak_mib"] - b["proof"]["peak_mib"] for b in real)
    assert rise == 476
    assert res.peaks_mib["burst"] - res.peaks_mib["load"] == pytest.approx(rise, abs=50)
    assert res.peaks_mib["burst"] < res.total_mib
