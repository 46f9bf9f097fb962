"""A V1 run's record (`tune.records.RunReport` with a `PinnedDerivation`): the KV pinned with
`--kv-cache-memory-bytes`, never r0.1's variables, and where the device's memory went (the
final configuration at its worst moment, the soak's growth, a vision-language model's images).
Every printed sum is built here from the figures report.json keeps, so that it adds up
(`tests/test_report_arithmetic.py` recomputes it); `report_sections` prints them, and
report.md and the startup files are written from the record by `tune.report`, like any run's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pretuner.deploy.context import RAY_BACKEND
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.engines.v1_images import Soak
from pretuner.launch.command import deployed_port, wrapped
from pretuner.launch.images import ImageShape, worst_case_images
from pretuner.pinned import kv_held_bytes
from pretuner.redact import redact_argv
from pretuner.report.records import (
    Asked,
    Final,
    PinnedDerivation,
    RunReport,
    V1Baseline,
    V1Budget,
    V1Images,
    V1Memory,
    V1Soak,
)
from pretuner.speed import too_slow
from pretuner.tune.pinned.loop import V1Result
from pretuner.tune.pinned.soak import HOLD_DOUBLINGS, soak_figures, soak_rate
from pretuner.tune.report import (
    RunMeta,
    boots_record,
    given_up,
    proof_peak,
    provenance,
    real_model,
    run_head,
    step_json,
)
from pretuner.tune.setup import Vision
from pretuner.units import GIB, MIB

if TYPE_CHECKING:
    from pretuner.tune.pinned.setup import PinnedMethod


def report_json(r: V1Result, m: RunMeta, x: PinnedMethod) -> RunReport:
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
    advice = next((o for o in r.outcomes if o.advised_kv_bytes is not None), None)
    budget = r.budget
    deployment = x.engine.deploy(f)
    argv = redact_argv(deployment.argv())  # serve.sh reads a secret from its variable
    if m.cluster and RAY_BACKEND[0] not in argv:  # proven on Ray's executor: served the same
        argv += RAY_BACKEND
    asked_len = m.asked_max_model_len or f.max_model_len
    asked_seqs = x.cfg.max_num_seqs
    # An emulated card's run (no --serve-cmd): what the real engine would run.
    real = [*x.engine.row.command, real_model(m, x.cfg.model.name), *argv]
    return RunReport(
        **run_head(m, [step_json(o) for o in r.outcomes], r.decisions, r.validated,
                   **x.layout(m.cluster)),
        final=Final(
            env=deployment.env, flags=argv,
            serve_command=redact_argv(wrapped([*x.engine.serve_command(x.cfg.card_gib),
                                                m.model_arg, *argv], deployed_port(argv),
                                               deployment.env)),
            engine_serve_command=real if m.simulated and not x.engine.serve_cmd else None,
            notes=list(deployment.notes), max_model_len=f.max_model_len,
            max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
            kv_tokens=r.kv_tokens, kv_gib=round((f.kv_cache_bytes or 0) / GIB, 3),
        ),
        derivation=PinnedDerivation(
            measured_by=r.measured_by, kv_cache_memory_bytes=f.kv_cache_bytes,
            baseline=V1Baseline(util=r.profiled_util, kv_tokens=r.profiled_kv_tokens,
                                kv_tokens_gain=round(gain, 4) if gain else None,
                                advised_kv_bytes=advice.advised_kv_bytes if advice else None,
                                advised_full_kv_bytes=advice.advised_full_kv_bytes
                                if advice else None),
            budget=None if budget is None else V1Budget(
                device_total_mib=budget.total_mib, device_peak_mib=budget.peak_mib,
                held_kv_mib=round(budget.held_kv_mib, 1),
                non_kv_peak_mib=round(budget.non_kv_mib, 1), margin_mib=budget.margin_mib,
                pinned_kv_mib=budget.kv_mib, lines=budget.lines()),
            memory=memory_record(proof, x.cfg.bytes_per_token, provenance(m.simulated))
            if proof else None,
            # the proof's own encoder budget, else any launch whose log said it
            images=images_record(x.vision, x.vision.images, proof or next(
                (o for o in r.outcomes if o.encoder_budget_tokens is not None), None),
                f.max_model_len)
            if x.vision is not None and x.vision.images is not None else None,
            soak=soak_record(proof, x.vision.soak) if proof and x.vision else None,
            weights=weights, speed=speed, min_tokens_per_s=x.min_tokens_per_s,
        ),
        asked=Asked(max_model_len=asked_len, max_num_seqs=asked_seqs),
        given_up=given_up(asked_len, asked_seqs, f.max_model_len, f.max_num_seqs)
        + ([slow] if slow else []),
        peak=proof_peak(proof),
        boots=boots_record(r.boot_peaks_mib, total, total)
        if proof is not None and (total := proof.device_total_mib) is not None else None,
    )


def final_launch(outcomes: tuple[LaunchOutcome, ...], final: LaunchSettings
                 ) -> LaunchOutcome | None:
    """The validation that proved the final configuration (the last one, when several did)."""
    return next((o for o in reversed(outcomes) if o.kind is OutcomeKind.OK
                 and o.settings.purpose is Purpose.VALIDATE and o.settings == final), None)


def images_record(v: Vision, shape: ImageShape, o: LaunchOutcome | None, max_model_len: int
                  ) -> V1Images:
    count, side = worst_case_images(shape, max_model_len, 1)
    return V1Images(
        image_limit=shape.image_limit,
        image_limit_source="--limit-mm-per-prompt" if v.limit_given else "vLLM's default",
        max_image_px=[shape.max_side_px, shape.max_side_px],
        tokens_per_image=shape.tokens_per_image,
        worst_case_images=count, worst_case_image_px=[side, side],
        encoder_budget_tokens=o.encoder_budget_tokens if o else None,
        encoder_profiled_images=o.encoder_profiled_items if o else None,
        mm_processor_cache_gb=v.mm_processor_cache_gb,
        flags=[part for name, value in v.flags
               for part in (name, *([] if value is None else [value]))])


def soak_record(o: LaunchOutcome, asked: Soak) -> V1Soak | None:
    f = soak_figures(o)
    if f is None:
        return None
    figures = {name: getattr(f, name) for name in V1Soak.model_fields if hasattr(f, name)}
    if o.device_total_mib is not None:
        r = soak_rate(o.soak_series, o.device_total_mib - f.after_mib)
        figures |= {"rate_bound": r.bound, "rate_samples": r.samples,
                    "rate_span_s": round(r.span_s, 1), "headroom_mib": r.headroom_mib,
                    "rate_mib_per_h": _round(r.rate_mib_per_h),
                    "exhaustion_h": _round(r.exhaustion_h, 3)}
    return V1Soak(launch=o.n, requests_asked=asked.requests, minutes_asked=asked.minutes,
                  **figures)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def memory_record(o: LaunchOutcome, bytes_per_token: int, tag: str) -> V1Memory | None:
    """The final configuration's device, from its own validation's samples; `tag` is what the
    samples are: "measured" on a real device, "simulated" on an emulated one."""
    total, kv = o.device_total_mib, o.settings.kv_cache_bytes
    held = kv_held_bytes(o.kv_tokens, bytes_per_token, o.kv_gib)
    if total is None or kv is None or held is None or not o.device_peaks_mib:
        return None
    f = soak_figures(o)
    peak = f.peak_before_mib if f is not None else max(o.device_peaks_mib.values())
    growth = f.peak_growth_mib if f is not None else 0
    hold = f.held_back_mib if f is not None else 0
    non_kv = peak - held / MIB
    pinned = kv / MIB
    free = total - non_kv - growth - hold - pinned
    lines = [
        f"non-KV peak: the worst moment before any soak (weights, activations, graphs"
        f"{', the encoder' if f is not None else ''}) = device peak {peak:,} MiB - KV held "
        f"{held / MIB:,.1f} MiB | {non_kv:,.1f} | {tag}",
    ]
    if f is not None:
        lines += [
            f"growth under the soak: the peak from the soak on ({f.peak_after_mib:,} MiB) above "
            f"the peak before it | {growth:,} | {tag}",
            f"held back for more growth: {HOLD_DOUBLINGS} x what the soak's second half still "
            f"added ({f.after_mib:,} - {f.half_mib:,} MiB) | {hold:,} | derived, kept free",
        ]
    lines += [
        f"pinned KV cache (--kv-cache-memory-bytes {kv}) | {pinned:,.1f} | derived",
        f"free at the worst moment (the rest; the pinned KV's unallocated tail, "
        f"{pinned - held / MIB:,.1f} MiB, is in it) | {free:,.1f} | computed",
        f"device total | {total:,} | {tag}",
    ]
    return V1Memory(launch=o.n, device_total_mib=total, kv_held_mib=round(held / MIB, 1),
                    non_kv_peak_mib=round(non_kv, 1), soak_growth_mib=growth,
                    held_back_mib=hold, pinned_kv_mib=round(pinned, 1),
                    free_mib=round(free, 1), lines=lines)
