"""`plan` headlines the layout `run` would launch, and refuses what `run` refuses (issue 26;
the bad-input cases are in tests/test_input_validation.py).

Run's side is `pretuner run --dry-run --json` (its setup, no launch) on the emulated cards; plan's
is `pretuner plan --json` with the same flags.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import invoke

LLAMA70 = "deepseek-r1-distill-llama-70b"

# Model, then the flags both commands take; each row once on plan, once on run.
SAME_LAYOUT = [
    pytest.param([LLAMA70, "--engine", "vllm", "--emulate", "--card", "80"], id="70b-80g-vllm-tp4-bf16"),
    pytest.param(["qwen3-32b", "--engine", "vllm", "--emulate", "--card", "80"], id="32b-80g-vllm-no-fp8"),
    pytest.param(["qwen3-8b", "--engine", "vllm", "--emulate"], id="vllm-default-card"),
    pytest.param(["qwen3-8b", "--engine", "vllm", "--emulate", "--card", "24", "--max-model-len", "32K"],
                 id="8b-24g-32k"),
    pytest.param(["qwen3-8b", "--engine", "vllm-ascend", "--emulate", "--card", "64"], id="ascend-block-128"),
    pytest.param(["qwen3-8b", "--engine", "vllm-ascend", "--emulate", "--card", "64", "--block-size", "16"],
                 id="ascend-explicit-block-16"),
    pytest.param(["qwen3-8b", "--engine", "vllm-mindspore", "--emulate", "--card", "64", "--tp", "2",
                  "--kv-cache-dtype", "fp8"], id="vllm-mindspore-tp2-fp8-kv"),
    pytest.param(["qwen3-32b", "--engine", "vllm", "--emulate", "--card", "24", "--tp", "1",
                  "--quantization", "bitsandbytes", "--max-model-len", "8192"],
                 id="32b-24g-bitsandbytes"),
    pytest.param(["qwen3-vl-8b", "--engine", "vllm", "--emulate", "--card", "32"], id="vl-model"),
    pytest.param(["deepseek-v3", "--card", "64"], id="r01-tp16-two-nodes"),
    pytest.param(["qwen3-8b", "--card", "32", "--max-model-len", "32K"], id="r01-32k"),
    pytest.param(["qwen3-32b", "--engine", "vllm-mindspore-r01", "--emulate", "--card", "64", "--pp", "2",
                  "--weights-format", "w8a8"], id="r01-pp2-w8a8"),
    pytest.param(["qwen3-8b"], id="r01-default-card"),
]  # fmt: skip


def _argv_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _run_side(dry: dict[str, Any]) -> dict[str, Any]:
    launch = dry["first_launch"]
    s, argv, env = launch["settings"], launch["argv"], launch["env"]
    quant = _argv_value(argv, "--quantization")
    return {
        "layout": dry["layout"], "tp": s["tp"], "pp": s["pp"], "card_gib": s["card_gib"],
        "block_size": s["block_size"], "max_model_len": s["max_model_len"],
        # r0.1's emulated card is told the weights format run decided on; a V1 server is told
        # the quantization (none: the checkpoint as stored).
        "weights": env.get("PRETUNER_SIM_WEIGHTS_FORMAT") if dry["method"] == "r0.1" else quant,
    }  # fmt: skip


def _plan_side(plan: dict[str, Any], r01: bool) -> dict[str, Any]:
    quant = plan["weights_plan"]["quantization"]
    return {
        "layout": plan["layout_reason"], "tp": plan["tp"], "pp": plan["pp"],
        "card_gib": plan["card_gib"], "block_size": plan["block_size"],
        "max_model_len": plan["max_model_len"],
        "weights": plan["weights_format"] if r01 else (quant.split("-")[0] if quant else None),
    }  # fmt: skip


@pytest.mark.parametrize("args", SAME_LAYOUT)
def test_plan_headlines_the_layout_run_launches(args: list[str]) -> None:
    model, *flags = args
    ran = invoke("run", "--model", model, *flags, "--dry-run", "--json")
    assert ran.returncode == 0, ran.stderr
    dry = json.loads(ran.stdout)
    planned = invoke("plan", "--model", model, *flags, "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert _plan_side(plan, dry["method"] == "r0.1") == _run_side(dry)


def test_the_issue_cases_decide_as_run() -> None:
    """Issue 26: plan used to headline 4-bit on one card for 70B on 80 GB, and fp8 for Qwen3-32B
    on one H100, where run launches 16-bit weights on more cards."""
    for model, tp in ((LLAMA70, 4), ("qwen3-32b", 2)):
        plan = json.loads(invoke("plan", "--model", model, "--engine", "vllm", "--emulate", "--card", "80",
                                 "--json").stdout)  # fmt: skip
        assert (plan["tp"], plan["weights_plan"]["quantization"]) == (tp, None)
        assert "as requested" not in plan["layout_reason"]


def test_plan_refuses_weights_that_fit_no_layout_as_run_does() -> None:
    argv = ["--model", "qwen3-32b", "--engine", "vllm", "--emulate", "--card", "24", "--tp", "1",
            "--max-model-len", "32768"]  # fmt: skip
    ran = invoke("run", *argv, "--dry-run")
    planned = invoke("plan", *argv)
    assert planned.returncode == ran.returncode == 4
    assert planned.stderr == ran.stderr
    assert "proposal for 32,768 tokens on 1 card(s)" in planned.stdout


def test_a_v1_table_has_no_r01_model_use_column() -> None:
    v1 = invoke("plan", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80")
    assert v1.returncode == 0, v1.stderr
    assert "model-use GiB" not in v1.stdout
    assert "KV GiB" in v1.stdout
    assert json.loads(invoke("plan", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                             "--json").stdout)["model_use_gib"] is None  # fmt: skip
    r01 = invoke("plan", "--model", "qwen3-8b", "--card", "64")
    assert "model-use GiB" in r01.stdout
