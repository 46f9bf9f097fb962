"""Big models on small cards: quantized weights, offload and swap in `plan`, and the proposal."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from pretuner.models import lookup
from pretuner.models.hf import spec_from_folder
from pretuner.models.quant import Quantization, from_config, from_flag, param_split, quantized_bytes
from pretuner.plan.layout import PlanConfig, plan
from pretuner.plan.propose import propose
from pretuner.units import GIB
from tests.helpers import CONFIGS, invoke

LLAMA70 = "deepseek-r1-distill-llama-70b"
FP8_CONFIG = CONFIGS / "Qwen--Qwen3-235B-A22B-FP8.json"


@pytest.mark.parametrize(
    ("quant", "low_gb", "high_gb"),
    [
        (Quantization("awq", 4, group_size=128), 37.0, 40.0),
        (Quantization("gptq", 4, group_size=128), 37.0, 40.0),
        (from_flag("bitsandbytes"), 37.0, 40.0),
        (Quantization("bitsandbytes", 4), 40.0, 43.0),  # fp32 absmax per 64
        (Quantization("bitsandbytes", 8), 71.0, 73.0),
        (from_flag("fp8"), 71.0, 73.0),  # 68.5e9 x 1 B + 2.1e9 x 2 B
    ],
)
def test_llama_70b_bytes_per_format(quant: Quantization, low_gb: float, high_gb: float) -> None:
    total = quantized_bytes(lookup(LLAMA70), quant)
    assert low_gb * 1e9 <= total <= high_gb * 1e9


@pytest.mark.parametrize(
    ("quant", "per_param"),
    [
        (Quantization("awq", 4, group_size=128), 0.5 + 2.5 / 128),
        (Quantization("gptq", 8, group_size=128), 1 + 3 / 128),
        (Quantization("bitsandbytes", 4, double_quant=True), 0.5 + 1 / 64 + 4 / (64 * 256)),
        (Quantization("bitsandbytes", 4), 0.5 + 4 / 64),
        (Quantization("fp8", 8, block_elems=128 * 128), 1 + 4 / 16384),
        (Quantization("fp8", 8), 1.0),
    ],
)
def test_linear_bytes_per_param(quant: Quantization, per_param: float) -> None:
    assert quant.linear_bytes_per_param == pytest.approx(per_param)


@pytest.mark.parametrize("name", ["qwen3-8b", LLAMA70, "qwen3-32b"])
def test_param_split_matches_dims_and_registry(name: str) -> None:
    spec = lookup(name)
    split = param_split(spec)
    assert split.how == "registry w8a8 derivation"
    assert split.linear_params + split.other_params == spec.total_params
    dims = param_split(dataclasses.replace(spec, weights=spec.weights[:1]))
    assert dims.how == "model dims"
    assert abs(dims.linear_params - split.linear_params) < 0.001 * spec.total_params


def test_quantization_config_from_hf_folder(tmp_path: Path) -> None:
    shutil.copy(FP8_CONFIG, tmp_path / "config.json")
    spec = spec_from_folder(tmp_path)
    q = spec.quantization
    assert q is not None
    assert (q.method, q.bits, q.block_elems) == ("fp8", 8, 128 * 128)
    assert "lm_head" in q.skipped
    assert q.source == "config.json quantization_config"
    r = plan(PlanConfig(model=spec, card_gib=80, tp=8, engine="vllm"))
    assert r.weights_plan is not None
    assert r.weights_plan.quantization == "fp8-8bit"


@pytest.mark.parametrize(
    ("qc", "expect"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, ("awq", 4, 128, False)),
        ({"quant_method": "gptq", "bits": 8, "group_size": -1}, ("gptq", 8, None, False)),
        (
            {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "bnb_4bit_use_double_quant": True,
            },
            ("bitsandbytes", 4, None, True),
        ),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, ("bitsandbytes", 8, None, False)),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g0": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 64}}
                },
            },
            ("compressed-tensors", 4, 64, False),
        ),
    ],
)
def test_from_config_table(qc: dict[str, object], expect: tuple[object, ...]) -> None:
    q = from_config({"quantization_config": qc})
    assert q is not None
    assert (q.method, q.bits, q.group_size, q.double_quant) == expect


def test_offload_lowers_card_weights_and_raises_host_memory() -> None:
    base = PlanConfig(
        model=lookup(LLAMA70), card_gib=32, tp=1, max_model_len=4096,
        quantization=from_flag("bitsandbytes"), engine="vllm", host_available_bytes=8 * GIB,
    )  # fmt: skip
    a = plan(dataclasses.replace(base, cpu_offload_gib=10))
    b = plan(dataclasses.replace(base, cpu_offload_gib=12, swap_space_gib=4))
    assert a.weights_bytes_per_card - b.weights_bytes_per_card == 2 * GIB
    assert b.requested.kv_bytes > a.requested.kv_bytes
    assert a.weights_plan is not None
    assert b.weights_plan is not None
    assert a.weights_plan.host_bytes == 10 * GIB
    assert b.weights_plan.host_bytes == 16 * GIB
    assert b.weights_plan.host_fits is False


def test_proposal_quantizes_then_offloads_whole_gib() -> None:
    cfg = PlanConfig(model=lookup(LLAMA70), card_gib=32, max_model_len=8192, engine="vllm")
    p = propose(cfg)
    assert p.chosen is not None
    assert p.chosen.fits
    assert [s.quantization for s in p.tried[:3]] == [None, "fp8-8bit", "bitsandbytes-nf4-dq"]
    assert p.chosen.quantization == "bitsandbytes-nf4-dq"
    k = p.chosen.cpu_offload_gib
    assert 1 <= k <= 20
    less = propose(dataclasses.replace(cfg, max_model_len=8192, tp=1))
    assert less.chosen == p.chosen
    assert p.chosen.max_num_seqs >= 1


def test_proposal_for_a_card_that_serves_as_is() -> None:
    p = propose(PlanConfig(model=lookup("qwen3-8b"), card_gib=80, engine="vllm"))
    assert p.chosen is not None
    assert p.chosen.fits
    assert p.chosen.label == "unquantized"


def test_cli_70b_on_one_32g_card_proposes_then_plans_the_proposal() -> None:
    """Run refuses 70B bf16 on one 32 GB card (exit 4), and so does plan, saying what would
    serve it there; the proposed flags then plan (and run) as a layout of their own."""
    args = ("plan", "--card", "32", "--model", LLAMA70, "--engine", "vllm", "--emulate", "--tp", "1",
            "--max-model-len", "8192")  # fmt: skip
    proc = invoke(*args)
    assert proc.returncode == 4, proc.stderr
    assert "proposed: bitsandbytes-nf4-dq + --cpu-offload-gb" in proc.stdout
    assert "--quantization bitsandbytes --cpu-offload-gb" in proc.stdout
    assert "host memory" in proc.stdout
    assert "--quantization bitsandbytes --cpu-offload-gb" in proc.stderr  # run's hint too
    assert len(proc.stderr.strip().splitlines()) == 1
    err = json.loads(invoke(*args, "--json").stdout)
    assert err["exit_code"] == 4
    assert err["fits"] is False
    chosen = err["proposal"]["chosen"]
    assert chosen["quantization"] == "bitsandbytes-nf4-dq"
    assert chosen["cpu_offload_gib"] >= 1
    proposed = invoke(*args, "--quantization", "bitsandbytes", "--cpu-offload-gb",
                      str(chosen["cpu_offload_gib"]), "--json")  # fmt: skip
    assert proposed.returncode == 0, proposed.stderr
    data = json.loads(proposed.stdout)
    wp = data["weights_plan"]
    assert wp["quantization"] == "bitsandbytes-nf4-dq"
    assert wp["cpu_offload_gib_per_card"] == chosen["cpu_offload_gib"]
    assert wp["host_fits"] in (True, False)
    assert data["max_num_seqs"] >= 1


def test_cli_nothing_fits_says_what_would() -> None:
    # --pp 1: TP alone (across 4 nodes the interconnect rule's TP8 x PP4 would serve it)
    proc = invoke("plan", "--card", "8", "--model", LLAMA70, "--engine", "vllm", "--emulate",
                  "--max-model-len", "128K", "--pp", "1")  # fmt: skip
    assert proc.returncode == 4
    assert "nothing tried serves" in proc.stdout
    assert "or: --max-model-len" in proc.stdout


def test_cli_plain_plan_unchanged_has_null_weights_plan_text() -> None:
    proc = invoke("plan", "--model", "qwen3-8b", "--card", "64")
    assert "weights as loaded" not in proc.stdout
    data = json.loads(invoke("plan", "--model", "qwen3-8b", "--card", "64", "--json").stdout)
    assert data["weights_plan"]["quantization"] is None
