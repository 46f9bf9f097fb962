"""The layout `run` launches and `plan` headlines (`decide_layout`), and when the card is too
small, the cheapest way to serve the requested length on it.

Quantize first (vLLM's in-flight fp8, then bitsandbytes 4-bit), and offload to host memory
only the weights that are still missing, in whole GiB (`--cpu-offload-gb` is paid on every
forward pass). When nothing serves the length, say what would: a shorter length, more cards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pretuner.errors import BadInputError, InfeasibleError, PretunerError
from pretuner.models.quant import Quantization, from_flag
from pretuner.plan.layout import TP_CANDIDATES, PlanConfig, PlanResult, plan
from pretuner.plan.weights import loaded
from pretuner.units import GIB

SHORTER = (16384, 8192, 4096, 2048, 1024, 512)


def decide_layout(cfg: PlanConfig) -> PlanResult:
    """The layout a run launches (TP, PP, weights as loaded), and the one `plan` headlines."""
    # Never quantizes on its own: weights that fit no layout of the cards asked for are
    # refused (exit 4), with what `propose` would serve them with on those cards.
    try:
        p = plan(cfg)
    except InfeasibleError as err:
        if not proposes(cfg):
            raise
        proposal = propose(cfg)
        if proposal.chosen is not None:
            flags = " ".join(f for f in proposal.flags if not f.startswith("--max-model-len"))
            err.hint = (f"{err.hint}; or on TP{proposal.tp}: {flags} ({proposal.chosen.label}, "
                        "predicted; a run with them measures it)")
        raise
    # A V1 engine reaches another node only through a Ray cluster: `plan` predicts the layout,
    # a run without one is refused before anything starts.
    if p.nodes > 1 and cfg.engine_class.pp_across_nodes and not cfg.cluster:
        raise BadInputError(
            f"TP{p.tp} x PP{p.pp} spans {p.nodes} nodes of {cfg.cards_per_node} cards: a V1 run "
            "across nodes needs a Ray cluster",
            hint=f"add --ray-address HOST:PORT (or auto) of a Ray cluster with {p.nodes} nodes, "
            "or --cards-per-node N if one node has more cards",
        )
    return p


def proposes(cfg: PlanConfig) -> bool:
    """Whether weights that fit no layout get a proposal: a V1 engine loading a 16-bit
    checkpoint as stored (quantization and offload are its flags)."""
    return cfg.engine_class.takes_weights_flags and not (
        cfg.quantization or cfg.cpu_offload_gib or cfg.model.quantization is not None)


@dataclass(frozen=True, slots=True)
class Step:
    """One combination tried, on the proposal's cards."""

    quantization: str | None
    cpu_offload_gib: int
    fits: bool
    card_weights_gib: float
    host_gib: float
    max_num_seqs: int
    why: str

    @property
    def label(self) -> str:
        offload = f" + --cpu-offload-gb {self.cpu_offload_gib}" if self.cpu_offload_gib else ""
        return (self.quantization or "unquantized") + offload

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Proposal:
    tp: int
    max_model_len: int
    tried: tuple[Step, ...]
    chosen: Step | None
    flags: tuple[str, ...]  # the vLLM flags of the chosen combination
    alternatives: tuple[str, ...]
    swap_gib: float = 0.0  # --swap-space per card, in the host figure

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "provenance": "predicted"}


def _try(cfg: PlanConfig, quant: Quantization | None, offload: int) -> Step:
    name = quant.name if quant else None
    try:
        r = plan(dataclasses.replace(cfg, quantization=quant, cpu_offload_gib=float(offload)))
    except PretunerError as err:
        return Step(name, offload, False, 0.0, 0.0, 0, err.message)
    host = r.weights_plan.host_bytes / GIB if r.weights_plan else 0.0
    seqs = r.requested.max_num_seqs
    why = (f"{seqs} sequence(s) of {cfg.max_model_len:,} tokens" if seqs
           else f"weights leave {r.requested.kv_tokens:,} KV tokens, under {cfg.max_model_len:,}")
    weights_gib = round(r.weights_bytes_per_card / GIB, 3)
    return Step(name, offload, seqs >= 1, weights_gib, round(host, 3), seqs, why)


def _smallest(cfg: PlanConfig, tried: list[Step]) -> Step | None:
    """Quantize step by step, then offload the smallest whole GiB that serves the length."""
    # the checkpoint's (or the user's) quantization, nothing else; else each in-flight one
    given = cfg.model.quantization is not None or cfg.quantization is not None
    ladder = [cfg.quantization] if given else [None, from_flag("fp8"), from_flag("bitsandbytes")]
    for quant in ladder:
        tried.append(step := _try(cfg, quant, 0))
        if step.fits:
            return step
    total, _ = loaded(cfg.model, cfg.weights_format, ladder[-1])
    per_card = total / ((cfg.tp or 1) * cfg.stages)
    for gib in range(1, math.ceil(per_card / GIB) + 1):
        step = _try(cfg, ladder[-1], gib)
        if step.fits:
            tried.append(step)
            return step
    if step.cpu_offload_gib:
        tried.append(step)  # even all weights on the host leave no room for one sequence
    return None


def _flags(cfg: PlanConfig, step: Step) -> tuple[str, ...]:
    flags: list[str] = [f"--max-model-len {cfg.max_model_len}"]
    if step.quantization and cfg.model.quantization is None:
        flags.append("--quantization " + step.quantization.split("-")[0])
    if step.cpu_offload_gib:
        flags.append(f"--cpu-offload-gb {step.cpu_offload_gib}")
    return tuple(flags)


def _alternatives(cfg: PlanConfig, tp: int, chosen: Step | None) -> list[str]:
    out: list[str] = []
    if chosen is None:
        for n in (n for n in SHORTER if n < cfg.max_model_len):
            step = _smallest(dataclasses.replace(cfg, max_model_len=n), [])
            if step is not None:
                out.append(f"--max-model-len {n} on {tp} card(s): {step.label}")
                break
    if chosen is None or chosen.quantization or chosen.cpu_offload_gib:
        for more in (more for more in TP_CANDIDATES if more > tp):
            if _try(dataclasses.replace(cfg, tp=more), None, 0).fits:
                out.append(f"more cards: TP{more} ({more * cfg.stages} cards) serves it "
                           "unquantized")
                break
    return out


def propose(cfg: PlanConfig) -> Proposal:
    """The cheapest combination that serves cfg.max_model_len on cfg.tp (default 1) cards."""
    tp = cfg.tp or 1
    cfg = dataclasses.replace(cfg, tp=tp)
    tried: list[Step] = []
    chosen = _smallest(cfg, tried)
    flags = _flags(cfg, chosen) if chosen else ()
    alts = tuple(_alternatives(cfg, tp, chosen))
    return Proposal(tp, cfg.max_model_len, tuple(tried), chosen, flags, alts, cfg.swap_space_gib)


def render_proposal(p: Proposal) -> list[str]:
    lines = [f"proposal for {p.max_model_len:,} tokens on {p.tp} card(s) (predicted):"]
    lines += [f"  {s.label}: {'serves' if s.fits else 'no'} - {s.why}" for s in p.tried]
    if p.chosen:
        lines.append(f"  proposed: {p.chosen.label}; host memory {p.chosen.host_gib:.2f} GiB "
                     f"({p.chosen.cpu_offload_gib} GiB offload + {p.swap_gib:g} GiB swap per "
                     "card)")
        lines.append(f"  vLLM flags: {' '.join(p.flags)}")
    else:
        lines.append("  nothing tried serves this length on these cards")
    return lines + [f"  or: {alt}" for alt in p.alternatives]
