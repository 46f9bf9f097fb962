"""Zero-launch prediction: weights, activations and KV per card, and the parallel layout.

Everything here is *predicted* from the model spec; a pre-run replaces the activation guess
with a measurement. The activation heuristic is deliberately simple and documented in
docs/benchmarks.md ("`plan` against MindSpore's measurements").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pretuner import validate as v
from pretuner.devices import select_reader
from pretuner.engines.base import Engine
from pretuner.engines.registry import engine_class
from pretuner.engines.v1_knobs import Knobs
from pretuner.engines.vllm_v1 import ROWS, V1Row, device_rule
from pretuner.errors import BadInputError, InfeasibleError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens, layers_per_stage, num_kv_blocks
from pretuner.method import DEFAULT_HEADROOM_GIB
from pretuner.models.quant import Quantization, from_flag
from pretuner.models.spec import ModelSpec
from pretuner.models.vision import DEFAULT_MM_PROCESSOR_CACHE_GIB, VisionPlan, plan_images
from pretuner.plan import weights as pw
from pretuner.units import GIB

if TYPE_CHECKING:  # the flags run and plan share, as the run was given them and resolved them
    from pretuner.tune.options import RunOptions
    from pretuner.tune.r01.config import TuneConfig

LADDER = (16384, 8192, 4096)
V1_MAX_MODEL_LEN = 16384  # a V1 run's length when neither --max-model-len nor its row says
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# Non-weight memory a server holds whatever the length: CANN/HCCL buffers, kernel workspace,
# the sampler. Measured runs replace it; 1 GiB matches the "non-framework < 1 GiB" of seed 003.
WORKSPACE_BYTES = 1 * GIB
# "Room for KV" when plan picks the layout: at least this share of card*util left for the KV
# cache. A layout that predicts room for a single sequence sits inside the prediction's error
# (gpt-oss-120b bf16 at TP4: 54 of 57.6 GiB in weights) and serves almost nobody.
MIN_KV_SHARE = 0.10
# Twice the TP is proposed when it serves this many times more max-length sequences per card
# (the weights it spreads free KV cache on every card: Qwen3-8B on a 24 GB card serves one
# 16k sequence at TP1, about nine at TP2); step by step, so the proposal stops where the next
# doubling of cards no longer doubles what each card serves.
BETTER_PER_CARD = 2.0
# The bytes per row and vocabulary entry of a top-k/top-p sampler: bf16 logits, their fp32
# copy, and the sort's fp32 values and int64 indices.
SORT_BYTES = 18


def layout_options(
    flags: RunOptions | TuneConfig, *, model: ModelSpec, card_gib: int, max_model_len: int,
    block_size: int, engine: str | None = None, knobs: Knobs | None = None,
    cluster: bool = False,
) -> PlanConfig:
    """The layout options of a run's flags, for `run` (r0.1 and V1) and `plan` alike."""
    quant = knobs.quantization if knobs else None
    return PlanConfig(
        model=model, card_gib=card_gib, util=flags.util, max_model_len=max_model_len,
        tp=flags.tp, pp=flags.pp, nodes=flags.nodes, cards_per_node=flags.cards_per_node,
        kv_cache_dtype=flags.kv_cache_dtype, block_size=block_size, cluster=cluster,
        weights_format=flags.weights_format,
        headroom_gib=DEFAULT_HEADROOM_GIB if flags.headroom_gib is None else flags.headroom_gib,
        quantization=from_flag(quant) if quant else None,
        cpu_offload_gib=knobs.cpu_offload_gib if knobs else 0.0,
        swap_space_gib=knobs.swap_gib if knobs else 0.0, engine=engine,
    )  # fmt: skip


def v1_layout_options(
    opts: RunOptions, row: V1Row, simulated: bool, model: ModelSpec, knobs: Knobs
) -> PlanConfig:
    """A V1 run's layout options: the engine's card, length and block size where none is given."""
    # vLLM on CPU and vllm-ascend default to 128-token blocks; the KV arithmetic counts the
    # engine's whole blocks, even where --block-size equals another engine's default.
    return layout_options(
        opts, model=model, card_gib=card_gib_for(row, simulated, opts.card_gib),
        max_model_len=opts.max_model_len or row.default_max_model_len or V1_MAX_MODEL_LEN,
        block_size=row.default_block_size if opts.block_size is None else opts.block_size,
        engine=row.name, knobs=knobs, cluster=opts.ray_address is not None,
    )  # fmt: skip


def card_gib_for(row: V1Row, simulated: bool, card_gib: int | None) -> int:
    """The card a V1 layout is sized on, for `run` and `plan` alike: --card when given, else
    the emulated H100 (80), a budgeted CPU's default, or the smallest device the reader shows."""
    if card_gib is not None or simulated:
        return card_gib or 80
    if row.default_card_gib is not None:  # a budgeted CPU "card": no device to read
        return row.default_card_gib
    reader = select_reader(row.device, dict(os.environ), 1)
    sample = reader.sample() if reader is not None else None
    if sample is None:
        raise BadInputError(f"no device size: no {row.device} device memory reader here",
                            hint="pass --card (the device's GB, e.g. --card 80)")
    return round(min(d.total_mib for d in sample.devices) / 1024)


def activation_bytes(spec: ModelSpec, tokens: int, tp: int) -> int:
    """Predicted activation peak of one prefill of `tokens` tokens on one card."""
    # Hidden states and their residual/norm copies (~4 x hidden) plus the MLP's gate/up/down
    # intermediates (~3 x intermediate / tp) per token, plus a fixed workspace. Flash attention
    # keeps attention linear in length, except for models declared with eager attention (the
    # CPU reference models): their score matrix, its masked copy and its softmax, (heads / tp)
    # x tokens^2 each, are alive together.
    per_token = 4 * spec.hidden_size + 3 * spec.intermediate_size // tp
    act = tokens * per_token * spec.dtype_bytes
    if spec.eager_attention:
        act += 3 * max(1, spec.num_heads // tp) * tokens * tokens * spec.dtype_bytes
    workspace = WORKSPACE_BYTES if spec.workspace_bytes is None else spec.workspace_bytes
    return act + workspace


def v1_activation_bytes(cfg: PlanConfig, row: V1Row, tp: int, length: int) -> int:
    """A V1 engine's profile peak: one step of chunked prefill (max_num_batched_tokens at
    most); for an MoE with the fused-MoE kernel's buffers, and on CUDA the sampler's."""
    spec, dt = cfg.model, cfg.model.dtype_bytes
    # The engine's defaults by vLLM's rule for a card of this size (plan sees no device name).
    seqs, batched = row.batch or device_rule(cfg.card_gib * GIB, "")
    tokens = min(length, cfg.max_num_batched_tokens or batched)
    act = activation_bytes(spec, tokens, tp)
    if not spec.num_experts_per_tok:
        return act
    # The routed experts stand for the dense MLP: gate/up, the activation and the output of
    # each of a token's top-k experts.
    inter = (spec.moe_intermediate_size or spec.intermediate_size) // tp
    experts = spec.num_experts_per_tok * (3 * inter + spec.hidden_size)
    act += tokens * dt * (experts - 3 * spec.intermediate_size // tp)
    if row.device != "cuda":
        return act
    # vLLM runs MoE models on its V1 GPU runner, whose profile run also samples max_num_seqs
    # dummy rows with top-k/top-p; the larger of the two is the peak.
    return max(act, activation_bytes(spec, 0, tp) + seqs * spec.vocab_size * SORT_BYTES)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """The layout options `run` and `plan` share, defaults resolved; None where the layout
    chooses (tp, nodes) or the checkpoint decides (weights format, quantization)."""

    model: ModelSpec
    card_gib: int
    util: float = 0.9
    max_model_len: int = 16384
    tp: int | None = None
    pp: int | None = None  # None: chosen (the interconnect rule on a V1 engine; else 1)
    nodes: int | None = None
    cards_per_node: int = 8
    # The layout may span nodes on a V1 engine: a run given a Ray cluster (--ray-address), or
    # `plan`, which only predicts.
    cluster: bool = False
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    weights_format: str | None = None
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    kv_gib: float | None = None
    # Vision-language models only (None: vLLM's defaults, see pretuner.models.vision).
    image_limit: int | None = None
    max_num_batched_tokens: int | None = None
    mm_processor_cache_gib: float = DEFAULT_MM_PROCESSOR_CACHE_GIB
    # Big models on small cards (pretuner.plan.weights); the defaults plan as before.
    quantization: Quantization | None = None
    cpu_offload_gib: float = 0.0
    swap_space_gib: float = 0.0
    engine: str | None = None  # None: vLLM-MindSpore r0.1's integer model-use GiB; else V1
    host_available_bytes: int | None = None

    @property
    def engine_class(self) -> type[Engine]:
        return engine_class(self.engine)

    @property
    def stages(self) -> int:
        """The pipeline stages: --pp, or the one the layout chose (1 before it chooses)."""
        return self.pp or 1


@dataclass(frozen=True, slots=True)
class LengthPlan:
    """The prediction for one max_model_len."""

    max_model_len: int
    activation_bytes: int
    # r0.1: the predicted vLLM_MODEL_MEMORY_USE_GB (integer, headroom included); a V1 engine
    # has no such variable (its KV cache is pinned in bytes): None.
    model_use_gib: int | None
    kv_bytes: int
    kv_tokens: int
    max_num_seqs: int

    @property
    def fits(self) -> bool:
        return self.max_num_seqs >= 1

    def to_json(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len,
                "activation_gib": round(self.activation_bytes / GIB, 3),
                "model_use_gib": self.model_use_gib, "max_kv_gib": round(self.kv_bytes / GIB, 3),
                "max_kv_tokens": self.kv_tokens, "max_num_seqs": self.max_num_seqs}


@dataclass(frozen=True, slots=True)
class PlanResult:
    model: str
    card_gib: int
    util: float
    tp: int
    pp: int
    nodes: int
    weights_format: str
    weights_bytes_per_card: int
    kv_bytes_per_token: int
    block_size: int
    requested: LengthPlan
    ladder: tuple[LengthPlan, ...]
    layout_reason: str
    rejected: tuple[tuple[int, int, str], ...] = ()  # (TP, PP, why)
    kv_query: tuple[float, int] | None = None  # (GiB asked, tokens that fit)
    notes: tuple[str, ...] = field(default=())
    vision: VisionPlan | None = None  # text-only models: None
    weights_plan: pw.WeightsPlan | None = None

    def to_json(self) -> dict[str, Any]:
        query = self.kv_query
        kv_query = {"kv_gib": query[0], "tokens": query[1]} if query else None
        return {
            "model": self.model, "card_gib": self.card_gib, "util": self.util, "tp": self.tp,
            "pp": self.pp, "nodes": self.nodes, "weights_format": self.weights_format,
            "weights_gib_per_card": round(self.weights_bytes_per_card / GIB, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token, "block_size": self.block_size,
            **self.requested.to_json(),
            "ladder": [lp.to_json() for lp in self.ladder],
            "layout_reason": self.layout_reason,
            "rejected_layouts": [{"tp": tp, "pp": pp, "reason": why}
                                 for tp, pp, why in self.rejected],
            "notes": list(self.notes), "kv_query": kv_query,
            "vision": self.vision.to_json() if self.vision else None,
            "weights_plan": self.weights_plan.to_json() if self.weights_plan else None,
            "provenance": "predicted",
        }  # fmt: skip


def _bpt(cfg: PlanConfig, tp: int) -> int:
    return kv_bytes_per_token(cfg.model, tp=tp, pp=cfg.stages, kv_dtype=cfg.kv_cache_dtype)


def _layout_error(cfg: PlanConfig, tp: int) -> str | None:
    try:
        _bpt(cfg, tp)
    except BadInputError as err:
        return err.message
    return None


def _length_plan(cfg: PlanConfig, tp: int, length: int) -> LengthPlan:
    weights = pw.weights_plan(cfg, tp * cfg.stages).card_weights_bytes
    bpt = _bpt(cfg, tp)
    row = ROWS.get(cfg.engine or "")
    act = (activation_bytes(cfg.model, length, tp) if row is None
           else v1_activation_bytes(cfg, row, tp, length))
    whole_gib = cfg.engine_class.budget_in_whole_gib
    model_use = math.ceil((weights + act) / GIB + cfg.headroom_gib) if whole_gib else None
    used = weights + act + int(cfg.headroom_gib * GIB) if model_use is None else model_use * GIB
    blocks = num_kv_blocks(int(cfg.card_gib * GIB * cfg.util) - used, bpt, cfg.block_size)
    tokens = blocks * cfg.block_size
    return LengthPlan(max_model_len=length, activation_bytes=act, model_use_gib=model_use,
                      kv_bytes=tokens * bpt, kv_tokens=tokens, max_num_seqs=tokens // length)


def _seqs(cfg: PlanConfig, tp: int) -> LengthPlan | None:
    """The requested length's prediction at TP `tp`, None where the model cannot split so."""
    return None if _layout_error(cfg, tp) else _length_plan(cfg, tp, cfg.max_model_len)


def _nodes_for(cfg: PlanConfig, tp: int) -> int:
    return max(1, math.ceil(tp * cfg.stages / cfg.cards_per_node))


def plan(cfg: PlanConfig) -> PlanResult:
    """Predict the memory split and pick (or check) the parallel layout."""
    # The values run and plan share were checked by `RunOptions.check()`; plan's own are here.
    if cfg.kv_gib is not None:
        v.positive("--kv-gib", cfg.kv_gib, example="36")
    limit = cfg.model.max_position_embeddings
    if cfg.max_model_len > limit:
        raise BadInputError(
            f"--max-model-len {cfg.max_model_len:,} exceeds {cfg.model.name}'s "
            f"max_position_embeddings {limit:,}",
            hint=f"use --max-model-len {limit} or less; pretuner will not tune past it (vLLM's "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 override risks wrong outputs); for more, pass a "
            "model folder whose config.json sets a larger max_position_embeddings",
        )
    if cfg.max_num_batched_tokens is not None:
        v.int_range("--max-num-batched-tokens", cfg.max_num_batched_tokens, 1)
    fmt = cfg.model.weights_format(cfg.weights_format)  # validates the name
    rejected: list[tuple[int, int, str]] = []
    notes: list[str] = []
    chooses_pp = cfg.pp is None and cfg.engine_class.pp_across_nodes
    if cfg.tp is not None:
        err = _layout_error(cfg, cfg.tp)
        if err:
            raise BadInputError(err)
        # A V1 engine given --tp alone that fills a node, whose weights fill the card at PP1,
        # gets a pipeline stage per node; a smaller TP is the user's cards on one node.
        weights = pw.weights_plan(cfg, cfg.tp).card_weights_bytes
        chooses_pp = (chooses_pp and cfg.tp >= cfg.cards_per_node
                      and weights >= cfg.card_gib * cfg.util * GIB)
    given = cfg.tp is not None or cfg.pp is not None
    if cfg.tp is not None and not chooses_pp:
        tp, cfg = cfg.tp, replace(cfg, pp=cfg.stages)
        reason = f"{_words(tp, cfg.stages)} as requested"
        _check_weights_fit(cfg, tp)
    else:
        cfg, tp, reason = _choose(cfg, rejected)
    if given:
        reason = _with_rule(cfg, tp, reason)
    better = _better_tp(cfg, tp) if cfg.tp is not None else None
    if better:
        notes.append(better[1])
    nodes = _nodes_for(cfg, tp)
    if cfg.nodes is not None:
        if cfg.nodes * cfg.cards_per_node < tp * cfg.stages:
            raise BadInputError(
                f"--nodes {cfg.nodes} x {cfg.cards_per_node} cards cannot hold "
                f"TP{tp} x PP{cfg.stages}",
                hint=f"use --nodes {nodes} or a smaller --tp",
            )
        nodes = cfg.nodes
    bpt = _bpt(cfg, tp)
    kv_query = None
    if cfg.kv_gib is not None:
        kv_query = (cfg.kv_gib, kv_tokens(int(cfg.kv_gib * GIB), bpt, cfg.block_size))
    wp = pw.weights_plan(cfg, tp * cfg.stages)
    # A VL model's images block; the tower stays in the model dtype (bf16 in w8a8).
    vision = None if cfg.model.vision is None else plan_images(
        cfg.model.vision, dtype_bytes=cfg.model.dtype_bytes, tp=tp,
        budget_bytes=int(cfg.card_gib * cfg.util * GIB), max_model_len=cfg.max_model_len,
        image_limit=cfg.image_limit, max_num_batched_tokens=cfg.max_num_batched_tokens,
        mm_processor_cache_gib=cfg.mm_processor_cache_gib,
    )  # fmt: skip
    return PlanResult(
        vision=vision, model=cfg.model.name, card_gib=cfg.card_gib, util=cfg.util,
        tp=tp, pp=cfg.stages, nodes=nodes, weights_format=wp.quantization or fmt.name,
        weights_bytes_per_card=wp.card_weights_bytes, weights_plan=wp, kv_bytes_per_token=bpt,
        block_size=cfg.block_size, requested=_length_plan(cfg, tp, cfg.max_model_len),
        ladder=tuple(_length_plan(cfg, tp, n) for n in LADDER if n < cfg.max_model_len),
        layout_reason=reason, rejected=tuple(rejected), kv_query=kv_query, notes=tuple(notes),
    )  # fmt: skip


def _words(tp: int, pp: int) -> str:
    return f"TP{tp}" + (f" x PP{pp}" if pp > 1 else "")


def _better_tp(cfg: PlanConfig, tp: int) -> tuple[int, str] | None:
    """The TP reached by doubling while each doubling serves BETTER_PER_CARD times more
    sequences per card, and the sentence that says so; None when the first does not."""
    base = _seqs(cfg, tp)
    if base is None:
        return None
    cur, cur_lp, pp = tp, base, cfg.stages
    room = max(cfg.cards_per_node, tp * pp)  # cards on the node(s) TP`tp` already takes
    while (nxt := cur * 2) in TP_CANDIDATES and nxt * pp <= room:
        lp = _seqs(cfg, nxt)
        if lp is None or not lp.fits:
            break
        if lp.max_num_seqs / nxt < BETTER_PER_CARD * max(cur_lp.max_num_seqs, 1e-9) / cur:
            break
        cur, cur_lp = nxt, lp
    if cur == tp:
        return None
    per_card = cur_lp.max_num_seqs / (cur * pp)
    base_per_card = base.max_num_seqs / (tp * pp)
    return cur, (
        f"TP{cur} serves {cur_lp.max_num_seqs} sequences of {cfg.max_model_len:,} tokens on "
        f"{cur * pp} cards ({per_card:.1f} per card), TP{tp} {base.max_num_seqs} on "
        f"{tp * pp} ({base_per_card:.1f} per card; predicted)"
    )


def smallest_weights_layout(cfg: PlanConfig) -> int | None:
    """The smallest TP whose weights leave room for KV on this card, by the checkpoint size."""
    for tp in TP_CANDIDATES:
        lp = _seqs(cfg, tp)
        if lp is not None and lp.fits:
            return tp
    return None


def _rule_layout(cfg: PlanConfig) -> tuple[PlanConfig, int] | None:
    """The layout the interconnect rule chooses when the user gave --tp/--pp (a V1 engine);
    None on r0.1 or where nothing fits."""
    if not cfg.engine_class.pp_across_nodes:
        return None
    try:
        rule, tp, _ = _choose(replace(cfg, tp=None, pp=None), [])
    except InfeasibleError:
        return None
    return rule, tp


def _with_rule(cfg: PlanConfig, tp: int, reason: str) -> str:
    """`reason`, and what the interconnect rule would choose where the user's --tp/--pp place
    the layout across nodes otherwise, and why."""
    found = _rule_layout(cfg)
    if found is None:
        return reason
    rule, rule_tp = found
    rule_nodes = _nodes_for(rule, rule_tp)
    if (rule_tp, rule.stages) == (tp, cfg.stages) or max(_nodes_for(cfg, tp), rule_nodes) == 1:
        return reason
    why = ("TP within a node, PP across nodes" if tp <= cfg.cards_per_node else
           f"TP{tp} across nodes sends every layer's all-reduce over the network, PP across "
           "nodes only the activations between stages")
    return (f"{reason}; the interconnect rule would choose {_words(rule_tp, rule.stages)} on "
            f"{rule_nodes} nodes: {why}")


def _check_weights_fit(cfg: PlanConfig, tp: int) -> None:
    """Refuse a layout whose weights alone fill the pool: no launch can change that."""
    weights = pw.weights_plan(cfg, tp * cfg.stages).card_weights_bytes
    cap = cfg.card_gib * cfg.util * GIB
    if weights < cap:
        return
    smallest = smallest_weights_layout(cfg)
    rule = _rule_layout(cfg)
    if rule is not None:
        hint = (f"use --tp {rule[1]} --pp {rule[0].stages} (the layout plan chooses: TP within "
                "a node, PP across nodes), or a quantized --weights-format")
    elif smallest:
        hint = (f"use --tp {smallest} (the smallest TP whose weights leave room for KV), or a "
                "quantized --weights-format")
    else:
        hint = "use --pp, a quantized --weights-format, or larger cards"
    raise InfeasibleError(
        f"TP{tp} x PP{cfg.stages}: {cfg.model.name}'s weights take {weights / GIB:.2f} GiB per "
        f"card, more than card*util = {cap / GIB:.2f} GiB (from the checkpoint size)",
        hint=hint,
    )


def _candidates(cfg: PlanConfig) -> list[tuple[int, int]]:
    """The (TP, PP) layouts the chooser tries, fewest cards first. By the interconnect rule (a
    V1 engine, no --pp): TP within a node, then one pipeline stage per node at the largest TP
    that divides the node. Else TP alone grows, across nodes too, at --pp stages (r0.1)."""
    if cfg.pp is not None or not cfg.engine_class.pp_across_nodes:
        return [(tp, cfg.stages) for tp in TP_CANDIDATES]
    if cfg.tp is not None:  # the user's TP filling a node, the fewest stages
        return [(cfg.tp, n) for n in range(1, max(2, TP_CANDIDATES[-1] // cfg.tp + 1))]
    node = cfg.cards_per_node
    within = [(tp, 1) for tp in TP_CANDIDATES if tp <= node]
    node_tp = next((tp for tp in reversed(TP_CANDIDATES)
                    if node % tp == 0 and _layout_error(cfg, tp) is None), None)
    if node_tp is None:
        return within
    return within + [(node_tp, n) for n in range(2, TP_CANDIDATES[-1] // node_tp + 1)]


def _choose(
    cfg: PlanConfig, rejected: list[tuple[int, int, str]]
) -> tuple[PlanConfig, int, str]:
    """The fewest cards whose weights leave room for KV, or a larger TP (`_better_tp`): the
    options with the chosen PP, the TP, and why."""
    cap_gib = cfg.card_gib * cfg.util
    for tp, pp in _candidates(cfg):
        c = replace(cfg, pp=pp)
        err = _layout_error(c, tp)
        if err:
            rejected.append((tp, pp, err))
            continue
        weights = pw.weights_plan(c, tp * pp).card_weights_bytes
        lp = _length_plan(c, tp, c.max_model_len)
        if lp.fits and lp.kv_bytes >= MIN_KV_SHARE * cap_gib * GIB:
            better = None if cfg.tp is not None else _better_tp(c, tp)
            if better is not None:
                rejected.append((tp, pp, f"fits, but {better[1]}"))
                return c, better[0], better[1]
            return c, tp, _why(c, tp, weights, lp, by_rule=cfg.pp is None)
        rejected.append((tp, pp, (
            f"weights {weights / GIB:.2f} GiB + activations {lp.activation_bytes / GIB:.2f} GiB "
            f"+ headroom leave {lp.kv_bytes / GIB:.2f} GiB of KV ({lp.kv_tokens:,} tokens), "
            f"under {MIN_KV_SHARE:.0%} of card*util"
        )))
    raise InfeasibleError(
        f"{cfg.model.name} does not fit on {cfg.card_gib} GiB cards at any layout up to "
        f"{TP_CANDIDATES[-1]} cards with --max-model-len {cfg.max_model_len:,}",
        hint="use a quantized --weights-format, a shorter --max-model-len, or --pp",
    )


def _why(c: PlanConfig, tp: int, weights: int, lp: LengthPlan, *, by_rule: bool) -> str:
    """The layout line's why: weights per card, the KV room they leave, and the rule."""
    nodes = _nodes_for(c, tp)
    room = (f"weights ({weights / GIB:.2f} GiB/card) leave at least {MIN_KV_SHARE:.0%} of "
            f"card*util = {c.card_gib * c.util:.2f} GiB for KV ({lp.kv_bytes / GIB:.2f} GiB "
            "predicted)")
    where = f"{_words(tp, c.stages)} on {nodes} node{'s' if nodes > 1 else ''}"
    if c.tp is not None:
        return f"{where}: TP{tp} as requested, and the fewest pipeline stages whose {room}"
    if by_rule and c.engine_class.pp_across_nodes and c.stages > 1:
        return (f"{where}: the fewest nodes of {c.cards_per_node} cards whose {room}; the "
                "interconnect rule: TP within a node, PP across nodes (one stage of "
                f"{layers_per_stage(c.model.num_layers, c.stages)} layers per node: only the "
                "activations between stages cross the network, no all-reduce)")
    if nodes > 1 and c.stages == 1 and not c.engine_class.pp_across_nodes:
        return (f"{where}: the smallest power-of-two TP whose {room}; the r0.1 method shards "
                "with TP only, so TP spans the nodes")
    return f"{where}: the smallest power-of-two TP whose {room}"
