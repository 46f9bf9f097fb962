"""What only the pinned-KV (V1) method adds to a run's report.md and summary (pure, from the
record): where the device's memory went (the final configuration at its worst moment, the
soak), a vision-language model's images, where the weights live, the speed, what each memory
flag does. Every printed sum is the record's (`tests/test_report_arithmetic.py` recomputes them).
"""

from __future__ import annotations

from pretuner.explain.measured import report_section
from pretuner.launch.images import IMAGE_WRAP_TOKENS
from pretuner.models.vision import VLLM_DEFAULT_MM_LIMIT
from pretuner.report.records import PinnedDerivation, RunReport, V1Weights
from pretuner.speed import Speed
from pretuner.tune.pinned.soak import HOLD_DOUBLINGS
from pretuner.units import GIB


def weights_lines(w: V1Weights, tag: str) -> list[str]:
    """Per card: loaded, offloaded, left on the card; the host's bill (sums that add up)."""
    lines = [f"loaded as {w.loaded_as}"
             + (f" (--quantization {w.quantization})" if w.quantization else "")
             + f": {w.loaded_gib_per_card:.2f} GiB per card = {w.card_weights_gib:.2f} GiB on "
             f"the card + {w.offloaded_gib_per_card:.2f} GiB offloaded (predicted)"]
    if w.card_weights_log_gib is not None:
        lines.append(f"on the card, as the engine loaded them: {w.card_weights_log_gib:.2f} GiB "
                     f"({tag}, 'Model loading took')")
    if w.offloaded_gib_per_card:
        host = (f"host memory: {w.host_offload_gib:.2f} GiB of pinned weights "
                "(--cpu-offload-gb, read over PCIe every step)")
        if w.host_available_gib is not None:
            host += f", of {w.host_available_gib:.2f} GiB available ({w.host_provenance})"
        lines.append(host)
    swap = "given" if w.swap_space_gib is not None else "the engine's default"
    lines.append(f"--swap-space: {w.host_swap_gib:.2f} GiB ({swap}) checked against the host's "
                 + (f"{w.host_total_gib:.2f} GiB" if w.host_total_gib else "memory")
                 + "; the V1 engine holds no KV there")
    if w.enforce_eager:
        lines.append("--enforce-eager: no CUDA-graph pool on the card")
    return lines


def speed_line(rep: RunReport, d: PinnedDerivation) -> str | None:
    s = d.speed
    if s is None:
        return None
    line = Speed.from_json(s.model_dump()).words(rep.provenance)
    if d.min_tokens_per_s is not None:
        line += f"; asked at least {d.min_tokens_per_s:g} tokens/s (--min-tokens-per-s)"
    return line


def pinned_sections(rep: RunReport, d: PinnedDerivation) -> list[str]:
    """report.md's sections of the pinned method, between the result and the launches."""
    tag = rep.provenance
    lines = images_md(d)
    if d.weights is not None:
        lines += ["## Weights", ""] + [f"- {x}" for x in weights_lines(d.weights, tag)] + [""]
    speed = speed_line(rep, d)
    if speed is not None:
        lines += ["## Speed", "", "- the validation's max-length request alone, then its "
                  f"concurrent load: {speed}", ""]
    lines += report_section(rep)
    lines += ["## Derivation", "", f"- method: pre-run with the production shape, memory "
              f"sampled ({d.measured_by}), KV pinned with --kv-cache-memory-bytes"]
    if d.budget is not None:
        lines += [f"- {line}" for line in d.budget.lines]
    else:
        lines.append("- no device memory was sampled: the engine's own profiled KV is pinned "
                     "(nothing gained over its profiling, but proven)")
    base = d.baseline
    if base.kv_tokens:
        gain = f"; the pinned KV holds {base.kv_tokens_gain:.3f}x that" if base.kv_tokens_gain \
            else ""
        lines.append(f"- the engine's own profiling at util {base.util}: "
                     f"{base.kv_tokens:,} KV tokens ({tag}){gain}")
    if (advice := advice_line(d, tag)) is not None:
        lines.append(f"- {advice}")
    return lines + [""] + memory_md(rep, d)


def summary_lines(rep: RunReport, d: PinnedDerivation) -> list[str]:
    """The run summary's lines of the pinned method: the sums, the soak, the device at its
    worst, the engine's own profiling, the weights and the speed."""
    tag = rep.provenance
    lines = list(d.budget.lines) if d.budget is not None else []
    if (k := d.soak) is not None:
        lines.append(f"soak: {k.requests:,} mixed image requests; device {k.before_mib:,} -> "
                     f"{k.after_mib:,} MiB ({k.growth_mib:+,} MiB after load, {tag}); "
                     f"/reset_mm_cache HTTP {k.reset_status or 'no answer'}"
                     + (f", gave back {k.reset_gave_back_mib:,} MiB"
                        if k.reset_gave_back_mib is not None else "")
                     + f"; {k.held_back_mib:,} MiB held back for more growth")
        lines.append(f"soak {k.rate_line(tag)}" + ("" if k.settled is not False else
                                                    "; NOT SETTLED"))
    if (m := d.memory) is not None:
        lines.append(f"device at its worst moment (launch {m.launch}, MiB, {tag}):")
        lines += ["  " + row.replace(" | ", ": ", 1).replace(" | ", ", ") for row in m.lines]
    base = d.baseline
    if base.kv_tokens and base.kv_tokens_gain:
        lines.append(f"the engine's own profiling at util {base.util}: {base.kv_tokens:,} "
                     f"tokens ({tag}); pinned holds {base.kv_tokens_gain:.3f}x that")
    if (advice := advice_line(d, tag)) is not None:
        lines.append(advice)
    w = d.weights
    if w is not None and (w.quantization or w.offloaded_gib_per_card or w.enforce_eager
                          or w.swap_space_gib is not None):
        lines.append("weights: " + "; ".join(weights_lines(w, tag)))
    speed = speed_line(rep, d)
    if speed is not None:
        lines.append(f"speed: {speed}")
    return lines


def advice_line(d: PinnedDerivation, tag: str) -> str | None:
    """The engine's own suggested KV beside the one pretuner pinned (which it never adopts: the
    engine's estimate comes from profiling, not a proof under load, and can be wrong)."""
    base = d.baseline
    if base.advised_kv_bytes is None or base.advised_full_kv_bytes is None:
        return None
    ours = d.kv_cache_memory_bytes or 0

    def words(n: int) -> str:
        return f"{n} B ({n / GIB:.2f} GiB{', negative: no usable advice' if n < 0 else ''})"

    return (f"the engine's own advice (its log at util {base.util}, {tag}; shown, not adopted): "
            f"--kv-cache-memory={words(base.advised_kv_bytes)} to fit that util, or "
            f"{words(base.advised_full_kv_bytes)} to fill the device; pretuner pinned "
            f"{words(ours)}, derived from the measured peak and proven under load")


def memory_md(rep: RunReport, d: PinnedDerivation) -> list[str]:
    """report.md's breakdown of the final configuration's device, and the soak, if any."""
    lines: list[str] = []
    m, tag = d.memory, rep.provenance
    if m is not None:
        lines += [f"## Memory of the final configuration (launch {m.launch}, device MiB, {tag})",
                  "", "| part | MiB | how |", "|---|---|---|"]
        lines += [f"| {row} |" for row in m.lines] + [""]
    s = d.soak
    if s is not None:
        asked = " or ".join(
            ([f"{s.requests_asked:,} requests"] if s.requests_asked is not None else [])
            + ([f"{s.minutes_asked:g} min"] if s.minutes_asked is not None else []))
        reset = (f"after it: {s.after_reset_mib:,} MiB, gave back {s.reset_gave_back_mib:,} MiB"
                 if s.after_reset_mib is not None else "the server did not reset (vLLM serves "
                 "the route with VLLM_SERVER_DEV_MODE=1)")
        lines += [
            f"## Soak (launch {s.launch}, device MiB, {tag})", "",
            f"- {s.requests:,} mixed image requests answered (asked: {asked}); image sizes and "
            "counts varied, every image distinct",
            f"- after the worst-case burst: {s.before_mib:,}; after the soak's first half: "
            f"{s.half_mib:,}; after the soak: {s.after_mib:,} = growth after load "
            f"{s.growth_mib:+,} MiB",
            f"- POST /reset_mm_cache: HTTP {s.reset_status or 'no answer'}; {reset}",
            f"- the second half still added {s.second_half_mib:,} MiB: {HOLD_DOUBLINGS} x that "
            f"= {s.held_back_mib:,} MiB held back as headroom (room for a "
            "run 4 times as long)",
            f"- peak before the soak {s.peak_before_mib:,}, from the soak on "
            f"{s.peak_after_mib:,} (the worst-case burst again after it included)"]
        lines.append(f"- {s.rate_line(tag)}")
        if s.settled is False:
            lines.append(f"- NOT SETTLED: the second half added {s.second_half_mib:,} of the "
                         f"soak's {s.growth_mib:,} MiB; memory was still growing fast: a longer "
                         "--soak measures more of it")
        lines.append("")
    return lines


def images_md(d: PinnedDerivation) -> list[str]:
    i = d.images
    if i is None:
        return []
    w, h = i.max_image_px
    cw, ch = i.worst_case_image_px
    budget = ("the engine's log did not say" if i.encoder_budget_tokens is None else
              f"{i.encoder_budget_tokens:,} tokens, profiled with {i.encoder_profiled_images} "
              "images of the largest size (the engine's log)")
    limit = "vLLM's 999" if i.image_limit == VLLM_DEFAULT_MM_LIMIT else str(i.image_limit)
    cache = ("vLLM's default (4 GiB of host memory per API server)"
             if i.mm_processor_cache_gb is None else f"{i.mm_processor_cache_gb:g} GiB (host)")
    return ["## Images", "",
            f"- images per prompt: {limit} ({i.image_limit_source}); largest image {w}x{h} px "
            f"= {i.tokens_per_image:,} tokens (+{IMAGE_WRAP_TOKENS} around each)",
            f"- the worst case sent: {i.worst_case_images} image(s) of {cw}x{ch} px per request, "
            "text filling the rest of max_model_len (chat API)",
            f"- encoder cache budget: {budget}",
            f"- processor cache: {cache}",
            f"- flags: {' '.join(i.flags) or 'none'}", ""]
