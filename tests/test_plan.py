"""Zero-launch predictions: layout choice, ladder, bad input, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pretuner.errors import BadInputError, InfeasibleError
from pretuner.models import ModelSpec, builtin_specs, lookup
from pretuner.plan.layout import PlanConfig, plan
from pretuner.units import GIB
from tests.helpers import invoke, shared


def test_deepseek_v3_w8a8_on_64g_needs_tp16_on_two_nodes() -> None:
    r = plan(PlanConfig(model=lookup("deepseek-v3"), card_gib=64))
    assert r.weights_format == "w8a8"
    assert (r.tp, r.nodes) == (16, 2)
    assert "TP16 on 2 nodes" in r.layout_reason
    assert [tp for tp, _, _ in r.rejected] == [1, 2, 4, 8]
    assert r.kv_bytes_per_token == 70_272
    assert r.requested.fits


@pytest.mark.parametrize(("name", "model"), [("A2-util090", "qwen3-8b"),
                                           ("G1-moe-util090", "qwen3-30b-a3b")])
def test_vllm_plan_predicts_the_real_h100_kv_tokens(name: str, model: str) -> None:
    """Issue 27 item 8: `plan --engine vllm --card 80` at the real run's util and length, TP1,
    within 5 % of its KV tokens, dense and MoE alike (one step of chunked prefill; an MoE's
    expert buffers and the sampler vLLM profiles it with)."""
    data = json.loads(shared("real-logs", "vllm-0.24-h100", f"{name}.json").read_text("utf-8"))
    cmd = data["cmd"]
    util = float(cmd[cmd.index("--gpu-memory-utilization") + 1])
    mml = int(cmd[cmd.index("--max-model-len") + 1])
    r = plan(PlanConfig(model=lookup(model), card_gib=80, util=util, max_model_len=mml, tp=1,
                        engine="vllm"))
    assert abs(r.requested.kv_tokens / data["kv_tokens"] - 1) <= 0.05


def test_vllm_activation_is_one_chunked_prefill_step_and_moe_adds_the_sampler() -> None:
    """A V1 engine prefills max_num_batched_tokens a step, whatever the length; vLLM profiles
    an MoE with max_num_seqs sampled rows, more of them on an 80 GiB card than a 64 GiB one."""
    def act(model: str, card: int, length: int) -> int:
        cfg = PlanConfig(model=lookup(model), card_gib=card, max_model_len=length, tp=1,
                         engine="vllm")
        return plan(cfg).requested.activation_bytes

    dense = [act("qwen3-8b", 80, n) for n in (32768, 16384, 8192, 4096)]
    assert dense[0] == dense[1] == dense[2] > dense[3]
    # 1024 rows on an 80 GiB card, 256 on a 64 GiB one; 151,936 logits of 18 B each
    assert act("qwen3-30b-a3b", 80, 8192) - act("qwen3-30b-a3b", 64, 8192) > 1.5 * GIB


def test_requested_tp_is_checked() -> None:
    with pytest.raises(BadInputError, match="not divisible by --tp 3"):
        plan(PlanConfig(model=lookup("qwen3-8b"), card_gib=64, tp=3))


def test_nodes_too_few_for_layout() -> None:
    with pytest.raises(BadInputError, match="--nodes 1 x 8 cards cannot hold TP16"):
        plan(PlanConfig(model=lookup("deepseek-v3"), card_gib=64, tp=16, nodes=1))


def test_nothing_fits_is_infeasible() -> None:
    with pytest.raises(InfeasibleError, match="does not fit on 2 GiB cards"):
        plan(PlanConfig(model=lookup("deepseek-v3"), card_gib=2, weights_format="bf16"))


def test_kv_gib_query_uses_block_rounding() -> None:
    r = plan(PlanConfig(model=lookup("deepseek-v3"), card_gib=64, kv_gib=36.28))
    assert r.kv_query == (36.28, 554_336)


def test_ladder_below_requested_length() -> None:
    r = plan(PlanConfig(model=lookup("qwen3-8b"), card_gib=32, max_model_len=32768))
    assert [lp.max_model_len for lp in r.ladder] == [16384, 8192, 4096]
    seqs = [lp.max_num_seqs for lp in (r.requested, *r.ladder)]
    assert seqs == sorted(seqs)


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(builtin_specs()),
    card=st.sampled_from([32, 64]),
    length=st.sampled_from([4096, 16384, 32768]),
)
def test_every_model_plans_or_says_why(spec: ModelSpec, card: int, length: int) -> None:
    if length > spec.max_position_embeddings:
        with pytest.raises(BadInputError, match="exceeds .* max_position_embeddings"):
            plan(PlanConfig(model=spec, card_gib=card, max_model_len=length))
        return
    try:
        r = plan(PlanConfig(model=spec, card_gib=card, max_model_len=length))
    except InfeasibleError as err:
        message = str(err)
    else:
        message = ""
    if message:
        assert "does not fit" in message
        return
    lp = r.requested
    assert lp.fits
    assert lp.kv_bytes >= 0
    assert r.weights_bytes_per_card + lp.activation_bytes < card * 0.9 * GIB


def test_cli_plan_json_keys() -> None:
    proc = invoke("plan", "--model", "DeepSeek-V3", "--card", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in (
        "model", "tp", "pp", "nodes", "kv_bytes_per_token", "weights_gib_per_card",
        "max_kv_gib", "max_kv_tokens", "max_num_seqs", "max_model_len",
    ):  # fmt: skip
        assert key in data
    assert data["tp"] == 16


def test_cli_plan_text_has_units() -> None:
    proc = invoke("plan", "--model", "qwen3-8b", "--card", "64")
    assert proc.returncode == 0, proc.stderr
    assert "GiB per card" in proc.stdout
    assert "predicted" in proc.stdout


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["--model", "deepseek-v4", "--card", "64"], 2, "did you mean deepseek-v3"),
        (["--model", "qwen3-8b", "--card", "0"], 2, "card size 0 GiB is invalid"),
        (["--model", "qwen3-8b", "--card", "64", "--util", "1.5"], 2, "outside (0, 1]"),
        (["--model", "deepseek-v3", "--card", "2", "--weights-format", "bf16"], 4, "does not fit"),
        (["--model", "qwen3-8b", "--card", "64", "--weights-format", "int3"], 2, "choose one of"),
    ],
)
def test_cli_plan_errors(args: list[str], code: int, fragment: str) -> None:
    proc = invoke("plan", *args)
    assert proc.returncode == code
    assert fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr
