"""The weights, speed and flags sections of a V1 run's report.md and summary (pure): where the
weights live (card, host), what the fit costs in speed, and what each memory flag does."""

from __future__ import annotations

from pretuner.explain import report_section
from pretuner.speed import Speed
from pretuner.tune.records import V1Report, V1Speed, V1Weights


def _speed(s: V1Speed) -> Speed:
    return Speed(s.prompt_tokens, s.ttft_s, s.decode_tokens, s.decode_s, s.load_requests,
                 s.load_tokens, s.load_s, s.how)


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


def speed_line(rep: V1Report) -> str | None:
    if rep.speed is None:
        return None
    line = _speed(rep.speed).words(rep.provenance)
    if rep.min_tokens_per_s is not None:
        line += f"; asked at least {rep.min_tokens_per_s:g} tokens/s (--min-tokens-per-s)"
    return line


def report_md_sections(rep: V1Report) -> list[str]:
    """`## Weights`, `## Speed` and `## What these flags do`, for report.md."""
    lines: list[str] = []
    if rep.weights is not None:
        lines += ["## Weights", ""] + [f"- {x}" for x in weights_lines(rep.weights,
                                                                    rep.provenance)] + [""]
    speed = speed_line(rep)
    if speed is not None:
        lines += ["## Speed", "", "- the validation's max-length request alone, then its "
                  f"concurrent load: {speed}", ""]
    return lines + report_section(rep.model_dump(mode="json"))


def summary_lines(rep: V1Report) -> list[str]:
    """The run summary's lines on weights and speed (empty for a run without them)."""
    lines: list[str] = []
    w = rep.weights
    if w is not None and (w.quantization or w.offloaded_gib_per_card or w.enforce_eager
                          or w.swap_space_gib is not None):
        lines.append("weights: " + "; ".join(weights_lines(w, rep.provenance)))
    speed = speed_line(rep)
    if speed is not None:
        lines.append(f"speed: {speed}")
    return lines
