"""How `pretuner run` shows a V1 engine's run and dry run."""

from __future__ import annotations

import shlex
from typing import Any

from pretuner.cli.render import table
from pretuner.engines.base import LaunchSettings
from pretuner.engines.registry import choose_engine
from pretuner.launch.images import worst_case_images
from pretuner.tune.entry import RunOptions
from pretuner.tune.v1.entry import V1RunOutcome, V1Setup, first_launch, v1_setup
from pretuner.tune.v1.report import SIM_NOTE, device_words
from pretuner.tune.v1.report_knobs import summary_lines

V1_SIM_BANNER = f"*** {SIM_NOTE} ***"


def v1_dry_run_json(opts: RunOptions) -> dict[str, Any]:
    """`run --dry-run --json` for a V1 engine: what the first launch would be, as data."""
    setup = v1_setup(opts, choose_engine(opts.engine))
    settings, cmd = first_launch(setup)
    shown = cmd.redacted()
    return {"dry_run": True, "method": "v1-pinned-kv", "engine": setup.choice.name,
            "engine_reason": setup.choice.reason, "simulated": setup.engine.simulated,
            "layout": setup.layout_reason,
            "device_reader": setup.ctx.device_reader.name if setup.ctx.device_reader else None,
            "first_launch": {"settings": settings.to_json(), "argv": shown.argv,
                             "env": shown.env},
            "images": _images_json(setup)}


def _images_json(setup: V1Setup) -> dict[str, Any] | None:
    """A vision-language model's worst case and soak, as the run will send them (predicted)."""
    shape = setup.images
    if shape is None:
        return None
    count, side = worst_case_images(shape, setup.cfg.max_model_len, 1)
    return {"image_limit": shape.image_limit, "worst_case_images": count,
            "worst_case_image_px": [side, side], "tokens_per_image": shape.tokens_per_image,
            "soak_requests": setup.soak.requests, "soak_minutes": setup.soak.minutes}


def render_v1_dry_run(opts: RunOptions) -> str:
    setup = v1_setup(opts, choose_engine(opts.engine))
    settings, cmd = first_launch(setup)
    lines = [V1_SIM_BANNER] if setup.engine.simulated else []
    lines += [
        f"engine: {setup.choice.name} ({setup.choice.reason})",
        f"layout: {setup.layout_reason}",
        f"device reader: {setup.ctx.device_reader.name if setup.ctx.device_reader else 'none'}",
        f"pre-run: {_prerun_kv(settings)}, max_model_len {settings.max_model_len:,}, "
        f"max-num-seqs {settings.max_num_seqs}, "
        f"max-num-batched-tokens {settings.max_num_batched_tokens:,}",
        *_images_words(setup),
        "first launch:",
        "  " + " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items()),
        "  " + shlex.join(cmd.argv),
    ]
    return "\n".join(lines)


def _images_words(setup: V1Setup) -> list[str]:
    shape = setup.images
    if shape is None:
        return []
    if shape.is_text_only:
        return ["images: none (--limit-mm-per-prompt image=0): text-only requests"]
    count, side = worst_case_images(shape, setup.cfg.max_model_len, 1)
    soak = f"then a soak of {setup.soak.words()}" if setup.soak.on else "no soak (--soak 0)"
    return [f"images: the worst case carries {count} image(s) of {side}x{side} px "
            f"({shape.tokens_per_image:,} tokens each) through the chat API; validation: the "
            f"longest text prefill, the image burst, {soak}, the burst again"]


def _prerun_kv(s: LaunchSettings) -> str:
    if s.kv_cache_bytes is None:
        return f"util {s.util:g} (the engine profiles)"
    return f"{s.kv_cache_bytes / 2**20:,.2f} MiB of KV pinned (one max-length sequence)"


def render_v1_summary(o: V1RunOutcome) -> str:
    rep = o.report
    f = rep.final
    tag = rep.provenance
    lines = [V1_SIM_BANNER] if rep.simulated else []
    status = "VALIDATED under the worst-case load" if rep.validated else "NOT VALIDATED"
    if rep.validated and rep.given_up:
        status = f"VALIDATED, BUT LESS THAN ASKED ({'; '.join(rep.given_up)})"
    lines += [
        f"{rep.model} on {rep.engine}, {device_words(rep)}, TP{rep.tp} x "
        f"PP{rep.pp}: {status} after {rep.launches} launch(es)",
        "",
    ]
    rows = []
    for s in rep.steps:
        kv = s.settings.kv_cache_bytes
        peak = max(s.device_peaks_mib.values(), default=None)
        rows.append((s.n, s.purpose,
                     f"{kv / 2**30:.2f} GiB pinned" if kv else f"util {s.settings.util}",
                     s.outcome, f"{peak:,}" if peak else "-",
                     f"{s.kv_tokens:,}" if s.kv_tokens else "-",
                     "-" if s.seconds is None else f"{s.seconds:.1f}"))
    lines.append(table(("#", "purpose", "KV", "outcome", f"device peak MiB ({tag})",
                        f"KV tokens ({tag})", "s"), rows))
    lines.append("")
    if rep.derivation is not None:
        lines += rep.derivation.lines
    lines.append(f"KV cache: --kv-cache-memory-bytes {f.kv_cache_memory_bytes} "
                 f"({f.kv_cache_gib:.2f} GiB, derived) = {f.kv_tokens or 0:,} tokens "
                 f"({tag})")
    if rep.soak is not None:
        k = rep.soak
        lines.append(f"soak: {k.requests:,} mixed image requests; device {k.before_mib:,} -> "
                     f"{k.after_mib:,} MiB ({k.growth_mib:+,} MiB after load, {tag}); "
                     f"/reset_mm_cache HTTP {k.reset_status or 'no answer'}"
                     + (f", gave back {k.reset_gave_back_mib:,} MiB"
                        if k.reset_gave_back_mib is not None else "")
                     + f"; {k.held_back_mib:,} MiB held back for more growth")
    if rep.memory is not None:
        lines.append(f"device at its worst moment (launch {rep.memory.launch}, MiB, {tag}):")
        lines += ["  " + row.replace(" | ", ": ", 1).replace(" | ", ", ") for row in
                  rep.memory.lines]
    base = rep.baseline
    if base.kv_tokens and base.kv_tokens_gain:
        lines.append(f"the engine's own profiling at util {base.util}: {base.kv_tokens:,} "
                     f"tokens ({tag}); pinned holds {base.kv_tokens_gain:.3f}x that")
    lines += summary_lines(rep)
    lines.append(shlex.join(f.serve_command))
    if f.engine_serve_command:
        lines.append(f"with the real engine (to be measured there): "
                     f"{shlex.join(f.engine_serve_command)}")
    lines += ["", f"run record: {o.record}  (report.md, report.html, serve.sh, "
              "vllm-config.yaml, tuned.env, pretuner-serve.service)"]
    return "\n".join(lines)
