"""Layouts across nodes: the interconnect rule (TP within a node, PP across nodes) in plan and
run, the user's --tp/--pp checked against it, and a V1 run across nodes only on a Ray cluster."""

from __future__ import annotations

import json

import pytest

from pretuner.errors import BadInputError, InfeasibleError
from pretuner.models import lookup
from pretuner.plan.layout import PlanConfig, plan
from pretuner.plan.propose import decide_layout
from pretuner.units import GIB
from tests.helpers import invoke

RULE = "the interconnect rule: TP within a node, PP across nodes"


@pytest.mark.parametrize(("model", "engine", "card", "per_node", "layout", "fragment"), [
    # DeepSeek-V3 FP8 (627 GiB): 78 GiB a card on one node of 8 is over 80 x 0.9 = 72 GiB;
    # two nodes at TP8 hold 39 GiB a card, a stage of 31 of its 61 layers each.
    ("deepseek-v3", "vllm", 80, 8, (8, 2, 2), RULE),
    ("deepseek-v3", "vllm-ascend", 64, 8, (8, 2, 2), RULE),
    # Four cards a node: TP4, and 627 / 8 cards = 78 GiB is still over 72: three stages.
    ("deepseek-v3", "vllm", 80, 4, (4, 3, 3), RULE),
    # One node of 16 cards holds it with TP alone: the rule places TP within that node.
    ("deepseek-v3", "vllm", 80, 16, (16, 1, 1), "smallest power-of-two TP"),
    # Fits one node: the single-node choice is unchanged.
    ("qwen3-235b-a22b", "vllm", 80, 8, (8, 1, 1), "smallest power-of-two TP"),
    ("qwen3-8b", "vllm", 80, 8, (1, 1, 1), "smallest power-of-two TP"),
    # r0.1's method shards with TP only: TP16 spans the two nodes, and the line says so.
    ("deepseek-v3", None, 64, 8, (16, 1, 2), "the r0.1 method shards with TP only"),
])  # fmt: skip
def test_the_chooser_keeps_tp_within_a_node_and_puts_pp_across_nodes(
    model: str, engine: str | None, card: int, per_node: int, layout: tuple[int, int, int],
    fragment: str,
) -> None:
    """Rule: past one node a V1 engine's layout is TP (at most the node's cards) x PP (one stage
    per node, the fewest nodes whose weights leave room for KV); r0.1 grows TP instead."""
    r = plan(PlanConfig(model=lookup(model), card_gib=card, engine=engine,
                        cards_per_node=per_node, cluster=True))
    assert (r.tp, r.pp, r.nodes) == layout, r.layout_reason
    assert fragment in r.layout_reason
    assert "GiB/card" in r.layout_reason  # the weights per card it rests on
    assert "for KV" in r.layout_reason  # and the KV room they leave


def test_kv_bytes_and_weights_per_card_follow_pp() -> None:
    """Each pipeline stage holds its share of the layers: DeepSeek-V3's MLA cache is
    (512 + 64) x 2 B per layer whatever the TP, so PP2 holds ceil(61 / 2) = 31 layers a card,
    and TP8 x PP2 splits the weights over 16 cards, as TP16 does."""
    spec = lookup("deepseek-v3")
    r = plan(PlanConfig(model=spec, card_gib=80, engine="vllm", cluster=True))
    assert (r.tp, r.pp) == (8, 2)
    assert r.kv_bytes_per_token == 31 * 576 * 2
    total = spec.weights_format(None).total_bytes
    assert r.weights_bytes_per_card == total // 16
    tp16 = plan(PlanConfig(model=spec, card_gib=80, engine="vllm", tp=16, pp=1, cluster=True))
    assert tp16.kv_bytes_per_token == 61 * 576 * 2
    assert tp16.weights_bytes_per_card == r.weights_bytes_per_card
    # The KV room is what the weights and activations leave of card*util, in whole blocks.
    lp = r.requested
    room = 80 * 0.9 * GIB - r.weights_bytes_per_card - lp.activation_bytes - 0.5 * GIB
    assert room - 16 * r.kv_bytes_per_token < lp.kv_bytes <= room


def test_a_v1_run_across_nodes_needs_a_ray_cluster_and_plan_predicts_it() -> None:
    """Rule: only a run given a cluster (--ray-address) or `plan` may span nodes on a V1 engine;
    a run on one machine is refused with the flag that fixes it (exit 2, before any launch)."""
    cfg = PlanConfig(model=lookup("deepseek-v3"), card_gib=80, engine="vllm")
    with pytest.raises(BadInputError, match="TP8 x PP2 spans 2 nodes") as err:
        decide_layout(cfg)
    assert "--ray-address" in (err.value.hint or "")
    assert decide_layout(PlanConfig(model=lookup("deepseek-v3"), card_gib=80, engine="vllm",
                                    cluster=True)).nodes == 2
    proc = invoke("run", "--model", "deepseek-v3", "--engine", "vllm", "--emulate", "--card",
                  "80", "--dry-run")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "add --ray-address" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_plan_deepseek_v3_on_80g_cards_is_tp8_pp2_and_says_why() -> None:
    proc = invoke("plan", "--model", "deepseek-v3", "--engine", "vllm", "--card", "80")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("layout:"))
    assert line.startswith("layout: TP8 x PP2 on 2 node(s)")
    assert "weights (39.17 GiB/card)" in line
    assert RULE in line
    assert "one stage of 31 layers per node" in line
    assert "35,712 bytes per token per card" in proc.stdout
    # The host memory a node pays: its own 8 cards' swap, not all 16 cards'.
    assert "x 8 card(s) = 32.00 GiB on each node" in proc.stdout


@pytest.mark.parametrize(("flags", "layout", "fragments"), [
    (["--tp", "16", "--pp", "1"], (16, 1, 2),
     ["TP16 as requested", "would choose TP8 x PP2 on 2 nodes",
      "TP16 across nodes sends every layer's all-reduce over the network"]),
    # --pp alone: TP grows at the user's PP; the rule's layout is named.
    (["--pp", "4"], (4, 4, 2), ["would choose TP8 x PP2 on 2 nodes", "TP within a node"]),
    # --tp alone whose weights fill the card at PP1 (78 GiB > 72): the fewest stages.
    (["--tp", "8"], (8, 2, 2), ["TP8 as requested, and the fewest pipeline stages"]),
])  # fmt: skip
def test_cli_plan_checks_the_users_layout_and_names_the_rules(
    flags: list[str], layout: tuple[int, int, int], fragments: list[str]
) -> None:
    """Rule: --tp/--pp given are the layout (checked, never replaced); where the interconnect
    rule would place the nodes otherwise, the layout line says what and why."""
    proc = invoke("plan", "--model", "deepseek-v3", "--engine", "vllm", "--card", "80", *flags,
                  "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["tp"], data["pp"], data["nodes"]) == layout
    for fragment in fragments:
        assert fragment in data["layout_reason"]


def test_tp_alone_short_of_a_node_is_never_given_stages() -> None:
    """--tp 1 is one card, as asked: its weights fit, or they are refused (exit 4) with the
    rule's layout; a pipeline stage is added only across nodes."""
    r = plan(PlanConfig(model=lookup("qwen3-8b"), card_gib=24, engine="vllm", tp=1))
    assert (r.tp, r.pp, r.nodes) == (1, 1, 1)
    assert r.layout_reason == "TP1 as requested"
    with pytest.raises(InfeasibleError, match="TP4 x PP1") as err:
        plan(PlanConfig(model=lookup("deepseek-v3"), card_gib=80, engine="vllm", tp=4))
    assert "use --tp 8 --pp 2" in (err.value.hint or "")


def test_cards_per_node_is_a_run_option_checked_as_plan_checks_it() -> None:
    for command in (["plan"], ["run", "--dry-run"]):
        proc = invoke(*command, "--model", "qwen3-8b", "--engine", "vllm", "--emulate",
                      "--card", "80", "--cards-per-node", "0")  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "--cards-per-node 0" in proc.stderr
