"""A V1 run's record (`tune.records.RunReport` with a `PinnedDerivation`): the KV pinned with
`--kv-cache-memory-bytes`, never r0.1's variables. report.md and the startup files are written
from the record by `tune.report`, like any run's."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pretuner import __version__
from pretuner.engines.base import Deployment
from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.vllm_v1 import ROWS
from pretuner.errors import PretunerError
from pretuner.models import resolve
from pretuner.report.records import (
    Asked,
    Decision,
    FailureReport,
    Final,
    PinnedDerivation,
    RunReport,
    Step,
    V1Baseline,
    V1Budget,
    V1Weights,
)
from pretuner.speed import too_slow
from pretuner.tune.asked import given_up
from pretuner.tune.report import failure_fields, provenance, step_json
from pretuner.tune.v1.loop import V1Result
from pretuner.tune.v1.report_memory import (
    VisionMeta,
    final_launch,
    images_record,
    memory_record,
    soak_record,
)
from pretuner.units import GIB


@dataclass(frozen=True, slots=True)
class V1Meta:
    run_id: str
    engine: str
    engine_version: str | None
    engine_reason: str
    simulated: bool
    model: str
    model_arg: str  # what the server loads
    card_gib: int
    bytes_per_token: int
    serve_command: tuple[str, ...]  # the server command before the model
    deployment: Deployment
    device_kind: str = "cuda"  # "cpu": --card is a memory budget, not a device
    asked_max_model_len: int | None = None  # None: the final's (V1 never cuts it)
    asked_max_num_seqs: int | None = None
    retune_command: tuple[str, ...] = ()  # RunOptions.command_line()
    vision: VisionMeta | None = None  # a vision-language model's images and soak
    weights: V1Weights | None = None  # the weights knobs and their plan (predicted)
    min_tokens_per_s: float | None = None  # --min-tokens-per-s asked
    card_source: str = "--card"
    weights_format: str = "bf16"
    kv_cache_dtype: str = "auto"


def _head(m: V1Meta, steps: list[Step], decisions: Iterable[Decision], validated: bool,
          tp: int, pp: int) -> dict[str, Any]:
    return {
        "pretuner_version": __version__, "run_id": m.run_id, "engine": m.engine,
        "engine_version": m.engine_version, "engine_reason": m.engine_reason,
        "simulated": m.simulated, "provenance": provenance(m.simulated), "model": m.model,
        "model_arg": m.model_arg, "card_gib": m.card_gib, "card_source": m.card_source,
        "device_kind": m.device_kind, "tp": tp, "pp": pp, "nodes": 1,
        # A run that quantized its weights: the format they loaded as (bitsandbytes-nf4-dq).
        "weights_format": m.weights.loaded_as if m.weights and m.weights.quantization
        else m.weights_format, "kv_cache_dtype": m.kv_cache_dtype,
        "kv_bytes_per_token": m.bytes_per_token, "validated": validated,
        "launches": len(steps), "steps": steps, "decisions": list(decisions),
        "retune_command": list(m.retune_command),
    }


def report_json(r: V1Result, m: V1Meta) -> RunReport:
    """The record of a finished V1 run; report.json is its `model_dump(mode="json")`."""
    f = r.final
    proof = final_launch(r.outcomes, f) if r.validated else None
    speed = step_json(proof).speed if proof is not None else None
    slow = too_slow(proof.speed, m.min_tokens_per_s) if proof is not None else None
    weights = m.weights
    if weights is not None and proof is not None:
        weights = weights.model_copy(update={"card_weights_log_gib": proof.weights_gib})
    gain = (r.kv_tokens / r.profiled_kv_tokens
            if r.kv_tokens and r.profiled_kv_tokens else None)
    budget = r.budget
    argv = m.deployment.argv()
    asked_len = m.asked_max_model_len or f.max_model_len
    asked_seqs = m.asked_max_num_seqs or f.max_num_seqs
    return RunReport(
        **_head(m, [step_json(o) for o in r.outcomes], r.decisions, r.validated, f.tp, f.pp),
        final=Final(
            env=m.deployment.env, flags=argv, serve_command=[*m.serve_command, m.model_arg, *argv],
            engine_serve_command=real_command(m) if m.simulated else None,
            notes=list(m.deployment.notes), max_model_len=f.max_model_len,
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
            memory=memory_record(proof, m.bytes_per_token, provenance(m.simulated))
            if proof else None,
            images=images_record(m.vision, proof or _any_launch(r), f.max_model_len)
            if m.vision is not None else None,
            soak=soak_record(proof, m.vision.soak) if proof and m.vision else None,
            weights=weights, speed=speed, min_tokens_per_s=m.min_tokens_per_s,
        ),
        asked=Asked(max_model_len=asked_len, max_num_seqs=asked_seqs),
        given_up=given_up(asked_len, asked_seqs, f.max_model_len, f.max_num_seqs)
        + ([slow] if slow else []),
    )


def _any_launch(r: V1Result) -> LaunchOutcome | None:
    """A launch whose log said what the engine's encoder budget is (any will do)."""
    return next((o for o in r.outcomes if o.encoder_budget_tokens is not None), None)


def real_command(m: V1Meta) -> list[str]:
    """What the real engine would run with the same flags (a simulated run's serve.sh starts
    the emulated server)."""
    model = resolve(m.model).hf_id or m.model
    return [*ROWS[m.engine].command, model, *m.deployment.argv()]


def failure_json(err: PretunerError, m: V1Meta, outcomes: Sequence[LaunchOutcome],
                 decisions: Iterable[Decision], tp: int, pp: int) -> FailureReport:
    """The record of a V1 run stopped by `err`: why, the fix, every launch and decision."""
    return FailureReport(**_head(m, [step_json(o) for o in outcomes], decisions, False, tp, pp),
                         method="v1-pinned-kv", **failure_fields(err))
