"""The parts of a V1 run's record that say where the device's memory went (pure): the final
configuration's memory at its worst moment, the soak's growth, and a vision-language model's
images. Every printed sum is built here from the figures report.json keeps, so that it adds up
(`tests/test_report_arithmetic.py` recomputes it); `report_sections` prints them."""

from __future__ import annotations

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.engines.v1_images import Soak
from pretuner.launch.images import ImageShape, worst_case_images
from pretuner.pinned import kv_held_bytes
from pretuner.report.records import V1Images, V1Memory, V1Soak
from pretuner.tune.pinned.soak import HOLD_DOUBLINGS, soak_figures
from pretuner.tune.setup import Vision
from pretuner.units import MIB


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
    return V1Soak(
        launch=o.n, requests_asked=asked.requests, minutes_asked=asked.minutes,
        requests=f.requests, before_mib=f.before_mib, half_mib=f.half_mib,
        after_mib=f.after_mib, after_reset_mib=f.after_reset_mib, reset_status=f.reset_status,
        growth_mib=f.growth_mib, reset_gave_back_mib=f.reset_gave_back_mib,
        second_half_mib=f.second_half_mib, held_back_mib=f.held_back_mib,
        peak_before_mib=f.peak_before_mib,
        peak_after_mib=f.peak_after_mib)


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
