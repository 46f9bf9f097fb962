"""`pretuner explain`: what each memory flag does, found by any spelling, with a run's figure;
and the speed verdict's arithmetic (`pretuner.speed`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretuner.explain.flags import FLAGS, find
from pretuner.explain.measured import MEASURED, report_section
from pretuner.report.records import (
    PinnedDerivation,
    RunReport,
    V1Baseline,
    V1Speed,
    V1Weights,
    read_report,
)
from pretuner.speed import Speed, too_slow
from tests.helpers import invoke

GOLDEN_R01 = Path(__file__).parent / "golden" / "run" / "report.json"
H200 = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200" / "run8k"


def v1_report() -> RunReport:
    """A V1 run's record (a 70B on a 32 GB card): a real run's, with the figures the
    explanations read."""
    base = read_report(H200)
    assert isinstance(base, RunReport)
    d = base.derivation
    assert isinstance(d, PinnedDerivation)
    assert d.budget is not None
    flags = ["--max-model-len", "8192", "--kv-cache-memory-bytes", "3898605568",
             "--quantization", "bitsandbytes", "--cpu-offload-gb", "14", "--enforce-eager"]
    return base.model_copy(update={
        "simulated": True, "provenance": "simulated", "validated": True,
        "final": base.final.model_copy(update={"kv_gib": 3.631, "kv_tokens": 11888,
                                               "max_model_len": 8192, "max_num_seqs": 8,
                                               "flags": flags}),
        "derivation": d.model_copy(update={
            "kv_cache_memory_bytes": 3898605568,
            "baseline": V1Baseline(util=0.9, kv_tokens=10256, kv_tokens_gain=1.159),
            "budget": d.budget.model_copy(update={
                "non_kv_peak_mib": 29020.0, "lines": ["non-KV peak = ...", "pinned KV = ..."]}),
            "weights": V1Weights(
                quantization="bitsandbytes", loaded_as="bitsandbytes-nf4-dq",
                cpu_offload_gib=14.0, swap_space_gib=None, enforce_eager=True,
                loaded_gib_per_card=36.803, offloaded_gib_per_card=14.0, card_weights_gib=22.803,
                card_weights_log_gib=22.82, host_offload_gib=14.0, host_swap_gib=4.0,
                host_available_gib=124.16, host_total_gib=128.0, host_provenance="simulated"),
            "speed": V1Speed(prompt_tokens=8176, ttft_s=15.33, decode_tokens=15, decode_s=15.96,
                             load_requests=1, load_tokens=15, load_s=None, how="streamed",
                             decode_tokens_per_s=0.9399, load_tokens_per_s=None)}),
    })


@pytest.mark.parametrize("spelling", ["--cpu-offload-gb", "cpu-offload-gb", "cpu_offload_gb",
                                      "CPU-OFFLOAD-GB"])
def test_a_flag_is_found_by_any_spelling(spelling: str) -> None:
    doc = find(spelling)
    assert doc is not None
    assert doc.name == "--cpu-offload-gb"


def test_every_flag_has_its_words_and_a_figure_reader() -> None:
    rep = v1_report()
    for doc in FLAGS:
        assert doc.summary
        assert doc.does
        assert doc.not_this
        assert MEASURED[doc.name](rep)
        assert find(doc.name) is doc  # every name, spelt as the engine spells it


@pytest.mark.parametrize(("flag", "says"), [
    ("--cpu-offload-gb", "14.00 GiB of the 36.80 GiB of weights per card in host memory, "
                         "22.80 GiB left on the card (predicted)"),
    ("--cpu-offload-gb", "decode 0.94 tokens/s for one sequence"),
    ("--swap-space", "(the engine's default); V1 engine: checked against the host"),
    ("--kv-cache-memory-bytes", "= 11,888 KV tokens (simulated), proven"),
    ("--gpu-memory-utilization", "gave 10,256 KV tokens (simulated); the pinned KV holds 1.159x"),
    ("--max-model-len", "holds 11,888 tokens = 1.45 such sequences"),
    ("--enforce-eager", "given: no CUDA-graph pool"),
    ("--quantization", "load as bitsandbytes-nf4-dq, 36.80 GiB per card (predicted)"),
])
def test_a_v1_runs_figures(flag: str, says: str) -> None:
    doc = find(flag)
    assert doc is not None
    assert says in "\n".join(MEASURED[doc.name](v1_report()))


def test_an_r01_runs_variables() -> None:
    rep = read_report(GOLDEN_R01)  # an r0.1 report.json of schema 1: it still reads
    assert isinstance(rep, RunReport)
    doc = find("vLLM_MODEL_MEMORY_USE_GB")
    assert doc is not None
    lines = MEASURED[doc.name](rep)
    assert lines[0] == "vLLM_MODEL_MEMORY_USE_GB=20"
    assert "19.21 GiB (derived from 'actual peak used' 22,329M, simulated)" in lines[1]
    v1_only = find("--cpu-offload-gb")
    assert v1_only is not None
    assert MEASURED[v1_only.name](rep) == ["not given: every weight stays on the card"]


def test_report_md_explains_the_flags_of_the_final_command() -> None:
    text = "\n".join(report_section(v1_report()))
    for flag in ("--cpu-offload-gb", "--quantization", "--enforce-eager",
                 "--kv-cache-memory-bytes", "--swap-space", "--gpu-memory-utilization"):
        assert f"`{flag}`" in text
    assert "`--kv-cache-dtype`" not in text  # not in the command
    assert "pinned KV = ..." not in text  # the derivation has its own section


def test_explain_lists_every_flag() -> None:
    proc = invoke("explain")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == len(FLAGS)


def test_an_unknown_flag_is_one_line_naming_the_close_one() -> None:
    proc = invoke("explain", "--swap-spaec")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("pretuner: error: no memory flag named '--swap-spaec'; did "
                                   "you mean --swap-space?")


def test_explain_refuses_a_folder_without_a_finished_run(tmp_path: Path) -> None:
    proc = invoke("explain", "--swap-space", "--run", str(tmp_path))
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr


def speed(decode_s: float, tokens: int = 15) -> Speed:
    return Speed(8176, 15.3, tokens, decode_s, 1, 16, 31.2, "streamed")


@pytest.mark.parametrize(("s", "asked", "verdict"), [
    (speed(15.0), None, None),
    (speed(15.0), 1.0, None),  # exactly 1 token/s meets 1
    (speed(30.0), 1.0, "decode 0.50 tokens/s < 1 asked (--min-tokens-per-s)"),
    (speed(1.0, tokens=0), 1.0, "decode speed not measured (--min-tokens-per-s 1 asked)"),
    (None, 2.5, "decode speed not measured (--min-tokens-per-s 2.5 asked)"),
])
def test_min_tokens_per_s(s: Speed | None, asked: float | None, verdict: str | None) -> None:
    assert too_slow(s, asked) == verdict


def test_speed_words_and_json_agree() -> None:
    s = speed(15.0)
    data = s.to_json()
    assert data["decode_tokens_per_s"] == 1.0
    assert data["load_tokens_per_s"] == pytest.approx(16 / 31.2, abs=1e-4)
    assert Speed.from_json(data) == s
    assert s.words("simulated") == (
        "decode 1.00 tokens/s (one sequence), first token after 15.30 s (8,176-token prompt), "
        "0.51 tokens/s generated by 1 concurrent max-length request, their prefill included "
        "(simulated, streamed)")
