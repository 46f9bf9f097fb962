"""Real vLLM 0.24 serving an MoE model on an H200 (`tests/fixtures/real/vllm-0.24-h200-moe`):
the whole `pretuner run` of the current code, then two more boots of the configuration it
proved. No emulator was calibrated on this card with an MoE model: the H200 rows were fitted to
the dense Qwen3-8B runs, the MoE terms to the H100's G1. So these runs are held-out data."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from pretuner.analyze.v1 import read_memory_series
from pretuner.engines.v1_launch import read_log
from pretuner.launch import probe
from pretuner.launch.images import TextRequest
from pretuner.sim.v1 import inproc
from pretuner.units import MIB
from tests.helpers import invoke, run_cli

MOE = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200-moe"
RUN = MOE / "run"
QWEN3_30B_A3B_BPT = 98_304  # 48 layers x 4 KV heads x 128 x 2 (K, V) x 2 B
H200_TOTAL_MIB = 143_771
H200_ENV = {"PRETUNER_SIM_PROFILE": "h200-141", "PRETUNER_SIM_SEED": "0",
            "PRETUNER_SIM_OCCUPIED_MIB": "0", "PRETUNER_SIM_STARTUP_S": "0.02",
            "PRETUNER_SIM_TIME_SCALE": "0.01"}


def report() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RUN / "report.json").read_text("utf-8"))
    return data


def boots() -> list[dict[str, Any]]:
    lines = (MOE / "boots" / "burst_spread.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines]


def pinned_bytes(boot: dict[str, Any]) -> int:
    argv = boot["argv"]
    return int(argv[argv.index("--kv-cache-memory-bytes") + 1])


def test_the_logs_say_what_the_run_recorded() -> None:
    rep = report()
    prerun, validate = (read_log(RUN / f"launch-{n}" / "server.log") for n in (1, 2))
    assert prerun.kv_tokens == rep["derivation"]["baseline"]["kv_tokens"] == 714_128
    assert prerun.weights_gib == validate.weights_gib == pytest.approx(56.88)
    assert not prerun.failed_oom
    assert not validate.failed_oom
    # The validation held the pinned bytes: whole blocks of 16 tokens of them.
    pinned = rep["derivation"]["kv_cache_memory_bytes"]
    assert validate.kv_tokens == rep["final"]["kv_tokens"] == 849_440
    assert validate.kv_tokens == pinned // (QWEN3_30B_A3B_BPT * 16) * 16


def test_the_derivation_adds_up_from_the_measured_peak() -> None:
    d = report()["derivation"]["budget"]
    series = read_memory_series((RUN / "launch-1" / "memory.tsv").read_text("utf-8"), "launch-1")
    assert series.source == "nvml"
    assert series.total_mib == H200_TOTAL_MIB
    assert series.peak_mib == d["device_peak_mib"] == 130_365
    assert d["held_kv_mib"] == 714_128 * QWEN3_30B_A3B_BPT / MIB
    assert d["non_kv_peak_mib"] == d["device_peak_mib"] - d["held_kv_mib"]
    assert d["pinned_kv_mib"] == int(d["device_total_mib"] - d["non_kv_peak_mib"]
                                     - d["margin_mib"])
    assert report()["derivation"]["kv_cache_memory_bytes"] == d["pinned_kv_mib"] * MIB


def test_the_proven_configuration_held_the_worst_case_with_the_margin_to_spare() -> None:
    # Launch 2: one 32k request, 25 at once, then 1,024 short ones at once, all answered; the
    # NVML peak stayed below the total by at least the margin the run kept.
    rep = report()
    series = read_memory_series((RUN / "launch-2" / "memory.tsv").read_text("utf-8"), "launch-2")
    assert [s["outcome"] for s in rep["steps"]] == ["ok", "ok"]
    margin = rep["derivation"]["budget"]["margin_mib"]
    assert series.peak_mib == 143_005
    assert H200_TOTAL_MIB - series.peak_mib == 766 >= margin == 719


def test_three_boots_of_the_proven_configuration_stay_within_the_margin_of_each_other() -> None:
    # The margin is a measured quantity: the spread between boots of the same configuration
    # (the run's launch 2 and two more) must be inside it, or the margin is too thin.
    more = boots()
    assert all(pinned_bytes(b) == report()["derivation"]["kv_cache_memory_bytes"] for b in more)
    assert all(b[p]["failed"] == 0 for b in more for p in ("single", "proof", "burst1", "burst2"))
    run_peak = read_memory_series((RUN / "launch-2" / "memory.tsv").read_text("utf-8"),
                                  "launch-2").peak_mib
    peaks = [run_peak, *(max(b[p]["peak_mib"] for p in ("proof", "burst1", "burst2"))
                         for b in more)]
    assert peaks == [143_005, 143_005, 142_973]
    assert max(peaks) - min(peaks) == 32 < report()["derivation"]["budget"]["margin_mib"]
    # Unlike the dense model's first boot (476 MiB), the MoE's 1,024-wide burst adds almost
    # nothing above the proof's peak: its sampler's logits were taken at start-up.
    assert max(b["burst2"]["peak_mib"] - b["proof"]["peak_mib"] for b in more) == 2


def test_the_boot_logs_pin_the_same_kv_as_the_run() -> None:
    for n in (1, 2):
        text = gzip.decompress((MOE / "boots" / f"boot-{n}.log.gz").read_bytes()).decode()
        assert "GPU KV cache size: 849,440 tokens" in text
        assert "Using TRITON Unquantized MoE backend" in text


def test_analyze_derives_the_same_pinned_kv_from_the_runs_own_series() -> None:
    launch = RUN / "launch-1"
    done = invoke("analyze", str(launch / "server.log"), "--memory-series",
                  str(launch / "memory.tsv"), "-m", "qwen3-30b-a3b", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["budget"]["kv_bytes"] == report()["derivation"]["kv_cache_memory_bytes"]
    assert data["total_mib"] == H200_TOTAL_MIB


def test_the_emulated_h200_boots_the_proven_moe_configuration_as_the_real_one_did() -> None:
    # Held out: the emulated card at the real run's pinned KV starts, serves the proof load and
    # the burst, logs the same KV tokens, and its NVML peak is within 0.5 % of the real boots'
    # non-KV memory, never below it (an emulated card kinder than the real one would pass
    # configurations the real card kills).
    argv = boots()[0]["argv"]
    prompt = probe.max_length_prompt_len(32_768, 32)
    res = inproc.run(["qwen3-30b-a3b", *argv[argv.index("--kv-cache-memory-bytes"):]],
                     H200_ENV, [prompt] * 25, 32, first=prompt,
                     burst=(TextRequest(128, 128),) * 1024)
    assert res.ready
    assert {r.status for r in res.replies} == {200}
    assert "GPU KV cache size: 849,440 tokens" in res.log
    assert res.total_mib == H200_TOTAL_MIB
    pinned_mib = pinned_bytes(boots()[0]) // MIB
    real_non_kv = statistics.mean(b["burst2"]["peak_mib"] for b in boots()) - pinned_mib
    emulated_non_kv = res.peaks_mib["burst"] - pinned_mib
    assert real_non_kv <= emulated_non_kv <= real_non_kv * 1.005
    assert res.peaks_mib["burst"] < H200_TOTAL_MIB


@pytest.mark.slow
def test_the_emulated_run_lands_within_one_percent_of_the_real_moe_run(tmp_path: Path) -> None:
    # The same command on the emulated H200 (max-num-seqs 1024: what the real engine chose on
    # this card): the engine's profile, the non-KV peak and the proven pinned KV within 1 % of
    # the real card's.
    done = run_cli("run", "--model", "qwen3-30b-a3b", "--engine", "vllm", "--emulate",
                   "--card", "141", "--max-model-len", "32768", "--max-num-seqs", "1024", "--json",
                   "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    emulated, real = json.loads(done.stdout), report()
    emu_d, real_d = emulated["derivation"], real["derivation"]
    assert emu_d["baseline"]["kv_tokens"] == pytest.approx(real_d["baseline"]["kv_tokens"],
                                                           rel=0.01)
    assert emu_d["budget"]["non_kv_peak_mib"] == pytest.approx(
        real_d["budget"]["non_kv_peak_mib"], rel=0.01)
    assert emulated["final"]["kv_tokens"] == pytest.approx(real["final"]["kv_tokens"], rel=0.01)
    assert [s["outcome"] for s in emulated["steps"]] == ["ok", "ok"]
