"""The method's arithmetic against the seed's worked example, its rules, and its invariants."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pretuner.errors import BadInputError, InfeasibleError
from pretuner.method import PrerunInputs, derive, max_num_seqs, per_sequence_bytes
from pretuner.units import GIB, MIB

DSV3_BPT = 70_272  # DeepSeek-V3 bf16 MLA: 61 layers x 576 x 2 B


def seed_inputs(**over: Any) -> PrerunInputs:
    base: dict[str, Any] = dict(
        card_gib=64,
        util=0.9,
        model_use_gib=50,
        actual_peak_mib=29614,
        kv_bytes_per_token=DSV3_BPT,
        block_size=16,
        max_model_len=16384,
    )
    base.update(over)
    return PrerunInputs(**base)


def test_seed_worked_example() -> None:
    d = derive(seed_inputs())
    assert round(d.kv_prerun_gib, 2) == 7.60
    assert round(d.actual_peak_bytes / GIB, 2) == 28.92
    assert round(d.weights_act_gib, 2) == 21.32
    assert round(d.max_kv_gib, 2) == 36.28
    assert 553_000 < d.max_kv_tokens < 555_000  # "about 554k tokens"
    assert d.max_kv_tokens % 16 == 0
    assert d.max_num_seqs_method == 33
    assert d.final.max_num_seqs == 33


def test_final_config_is_integer_and_reports_rounding_cost() -> None:
    d = derive(seed_inputs(headroom_gib=0.5))
    f = d.final
    assert f.env == {"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "22"}
    assert f.flags["max_model_len"] == 16384
    assert f.flags["max_num_batched_tokens"] == 16384
    assert f.flags["gpu_memory_utilization"] == 0.9
    assert round(d.model_use_exact_gib, 2) == 21.82
    assert round(d.rounding_cost_bytes / GIB, 2) == 0.18
    # The final KV is what r0.1 allocates with these integers.
    assert f.kv_bytes == (int(64 * GIB * 0.9) - 22 * GIB) // (16 * DSV3_BPT) * 16 * DSV3_BPT


def test_final_util_recovers_kv() -> None:
    low = derive(seed_inputs())
    high = derive(seed_inputs(final_util=0.93))
    assert high.final.kv_bytes > low.final.kv_bytes
    assert high.final.gpu_memory_utilization == 0.93


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"model_use_gib": 58}, "model-use 58 GiB >= card*util = 57.60 GiB"),
        ({"model_use_gib": 57, "util": 0.89}, "model-use 57 GiB >= card*util = 56.96 GiB"),
        ({"card_gib": 0}, "card size 0 GiB is invalid"),
        ({"util": 0.0}, "--util 0.0 is outside (0, 1]"),
        ({"util": 1.2}, "--util 1.2 is outside (0, 1]"),
        ({"max_model_len": 0}, "--max-model-len 0 is invalid"),
        ({"actual_peak_mib": 7000}, "is not above the pre-run's KV cache"),
        ({"headroom_gib": -1.0}, "headroom -1.0 GiB is negative"),
    ],
)
def test_bad_input_messages(over: dict[str, object], fragment: str) -> None:
    with pytest.raises(BadInputError) as err:
        derive(seed_inputs(**over))
    assert fragment in str(err.value)


def test_infeasible_length_says_what_fits() -> None:
    # 55 GiB of weights+activations leaves ~2 GiB: not one 65k sequence.
    with pytest.raises(InfeasibleError) as err:
        derive(seed_inputs(actual_peak_mib=int((55 + 7.6) * 1024), max_model_len=65536))
    msg = str(err.value)
    assert "not one sequence" in msg
    assert "max-model-len of at most" in msg


def test_batched_tokens_larger_than_kv_is_refused() -> None:
    with pytest.raises(InfeasibleError) as err:
        derive(seed_inputs(max_num_batched_tokens=10_000_000))
    assert "--max-num-batched-tokens 10,000,000 exceeds" in str(err.value)


def test_weights_exceeding_card_is_infeasible() -> None:
    with pytest.raises(InfeasibleError) as err:
        derive(seed_inputs(actual_peak_mib=80 * 1024))
    assert "more than card*util" in str(err.value)


peaks = st.integers(min_value=8 * 1024, max_value=56 * 1024)
lengths = st.sampled_from([1024, 2048, 4096, 8192, 16384, 32768])


@given(peak=peaks, length=lengths, headroom=st.floats(0, 2))
def test_parts_sum_and_never_negative(peak: int, length: int, headroom: float) -> None:
    try:
        d = derive(seed_inputs(actual_peak_mib=peak, max_model_len=length, headroom_gib=headroom))
    except InfeasibleError:
        return
    assert d.weights_act_bytes + d.kv_prerun_bytes == d.actual_peak_bytes
    assert d.max_kv_bytes + d.weights_act_bytes == int(64 * GIB * 0.9)
    assert d.final.kv_bytes >= 0
    assert d.final.max_num_seqs >= 1
    assert d.final.kv_tokens >= d.final.max_num_seqs * length
    assert 0 <= d.rounding_cost_bytes < GIB
    assert d.final.vllm_model_memory_use_gb >= d.weights_act_bytes / GIB + headroom - 1e-6


@given(peak=peaks, a=lengths, b=lengths)
def test_monotone_in_max_model_len(peak: int, a: int, b: int) -> None:
    short, long_ = sorted((a, b))
    try:
        d_long = derive(seed_inputs(actual_peak_mib=peak, max_model_len=long_))
    except InfeasibleError:
        return
    d_short = derive(seed_inputs(actual_peak_mib=peak, max_model_len=short))
    assert d_short.final.max_num_seqs >= d_long.final.max_num_seqs


@given(p1=peaks, p2=peaks)
def test_monotone_in_peak(p1: int, p2: int) -> None:
    lo, hi = sorted((p1, p2))
    d_lo = derive(seed_inputs(actual_peak_mib=lo, max_model_len=1024))
    try:
        d_hi = derive(seed_inputs(actual_peak_mib=hi, max_model_len=1024))
    except InfeasibleError:
        return
    assert d_hi.final.kv_bytes <= d_lo.final.kv_bytes
    assert d_hi.final.vllm_model_memory_use_gb >= d_lo.final.vllm_model_memory_use_gb


def test_mib_is_1024_based() -> None:
    assert MIB * 1024 == GIB


@pytest.mark.parametrize(
    ("blocks", "watermark", "seqs"),
    [(1000, 0.0, 10), (1000, 0.01, 9), (1009, 0.01, 9), (1010, 0.01, 10), (1010, 0.0, 10)],
)
def test_the_block_watermark_costs_exactly_its_blocks(
    blocks: int, watermark: float, seqs: int
) -> None:
    # Rule: vLLM 0.6 keeps int(watermark x blocks) blocks free, so 10 sequences of 100 blocks
    # need 1,000 blocks without it and 1,010 beside a 1 % watermark (10 of them kept free).
    assert max_num_seqs(blocks, 16, 1600, watermark) == seqs


def test_each_running_sequence_adds_three_fp32_vocab_rows_and_4_mib() -> None:
    # Qwen3's vocabulary, 151,936 entries: 3 x 151,936 x 4 B = 1,823,232 B, plus 4 MiB.
    assert per_sequence_bytes(151_936) == 1_823_232 + 4 * MIB


def test_the_docs_state_the_per_sequence_headroom_the_code_adds() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs"
    method = (docs / "method.md").read_text(encoding="utf-8")
    m = re.search(r"adds 3 x vocab x 4 B \+ (\d+) MiB", method)
    assert m is not None, "docs/method.md's Headroom no longer states the per-sequence figure"
    assert per_sequence_bytes(1000) == 3 * 1000 * 4 + int(m[1]) * MIB
