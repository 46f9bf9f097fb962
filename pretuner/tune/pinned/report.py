"""A V1 run's record (`tune.records.RunReport` with a `PinnedDerivation`): the KV pinned with
`--kv-cache-memory-bytes`, never r0.1's variables. report.md and the startup files are written
from the record by `tune.report`, like any run's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.vllm_v1 import V1Engine
from pretuner.report.records import (
    Asked,
    Final,
    PinnedDerivation,
    RunReport,
    V1Baseline,
    V1Budget,
    V1Weights,
)
from pretuner.speed import too_slow
from pretuner.tune.pinned.loop import V1Result
from pretuner.tune.pinned.report_memory import (
    final_launch,
    images_record,
    memory_record,
    soak_record,
)
from pretuner.tune.report import (
    RunMeta,
    given_up,
    provenance,
    real_model,
    run_head,
    step_json,
)
from pretuner.tune.setup import Vision
from pretuner.units import GIB


@dataclass(frozen=True, slots=True)
class PinnedFacts:
    """What a V1 run's report says besides the common `RunMeta`."""

    engine: V1Engine
    model: str
    card_gib: int
    bytes_per_token: int
    asked_max_num_seqs: int
    weights_format: str = "bf16"
    vision: Vision | None = None  # a vision-language model's images and soak
    weights: V1Weights | None = None  # the weights knobs and their plan (predicted)
    min_tokens_per_s: float | None = None  # --min-tokens-per-s asked


def pinned_layout(x: PinnedFacts, tp: int, pp: int) -> dict[str, Any]:
    # A run that quantized its weights: the format they loaded as (bitsandbytes-nf4-dq).
    loaded = x.weights.loaded_as if x.weights and x.weights.quantization else x.weights_format
    return {"model": x.model, "card_gib": x.card_gib, "tp": tp, "pp": pp, "nodes": 1,
            "weights_format": loaded, "kv_bytes_per_token": x.bytes_per_token}


def report_json(r: V1Result, m: RunMeta, x: PinnedFacts) -> RunReport:
    """The record of a finished V1 run; report.json is its `model_dump(mode="json")`."""
    f = r.final
    proof = final_launch(r.outcomes, f) if r.validated else None
    speed = step_json(proof).speed if proof is not None else None
    slow = too_slow(proof.speed, x.min_tokens_per_s) if proof is not None else None
    weights = x.weights
    if weights is not None and proof is not None:
        weights = weights.model_copy(update={"card_weights_log_gib": proof.weights_gib})
    gain = (r.kv_tokens / r.profiled_kv_tokens
            if r.kv_tokens and r.profiled_kv_tokens else None)
    budget = r.budget
    deployment = x.engine.deploy(f)
    argv = deployment.argv()
    asked_len = m.asked_max_model_len or f.max_model_len
    asked_seqs = x.asked_max_num_seqs or f.max_num_seqs
    # An emulated card's run (no --serve-cmd): what the real engine would run.
    real = [*x.engine.row.command, real_model(m, x.model), *argv]
    return RunReport(
        **run_head(m, [step_json(o) for o in r.outcomes], r.decisions, r.validated,
                   **pinned_layout(x, f.tp, f.pp)),
        final=Final(
            env=deployment.env, flags=argv,
            serve_command=[*x.engine.serve_command(x.card_gib), m.model_arg, *argv],
            engine_serve_command=real if m.simulated and not x.engine.serve_cmd else None,
            notes=list(deployment.notes), max_model_len=f.max_model_len,
            max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
            kv_tokens=r.kv_tokens, kv_gib=round((f.kv_cache_bytes or 0) / GIB, 3),
        ),
        derivation=PinnedDerivation(
            measured_by=r.measured_by, kv_cache_memory_bytes=f.kv_cache_bytes,
            baseline=V1Baseline(util=r.profiled_util, kv_tokens=r.profiled_kv_tokens,
                                kv_tokens_gain=round(gain, 4) if gain else None),
            budget=None if budget is None else V1Budget(
                device_total_mib=budget.total_mib, device_peak_mib=budget.peak_mib,
                held_kv_mib=round(budget.held_kv_mib, 1),
                non_kv_peak_mib=round(budget.non_kv_mib, 1), margin_mib=budget.margin_mib,
                pinned_kv_mib=budget.kv_mib, lines=budget.lines()),
            memory=memory_record(proof, x.bytes_per_token, provenance(m.simulated))
            if proof else None,
            images=images_record(x.vision, x.vision.images, proof or _any_launch(r),
                                 f.max_model_len)
            if x.vision is not None and x.vision.images is not None else None,
            soak=soak_record(proof, x.vision.soak) if proof and x.vision else None,
            weights=weights, speed=speed, min_tokens_per_s=x.min_tokens_per_s,
        ),
        asked=Asked(max_model_len=asked_len, max_num_seqs=asked_seqs),
        given_up=given_up(asked_len, asked_seqs, f.max_model_len, f.max_num_seqs)
        + ([slow] if slow else []),
    )


def _any_launch(r: V1Result) -> LaunchOutcome | None:
    """A launch whose log said what the engine's encoder budget is (any will do)."""
    return next((o for o in r.outcomes if o.encoder_budget_tokens is not None), None)

