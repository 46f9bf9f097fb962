"""What `pretuner run` prints: the summary of a finished run (one renderer, either method, from
its record) and each method's dry run (text and JSON), which has no record yet."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from pretuner.cli.render import table
from pretuner.engines.base import LaunchSettings
from pretuner.launch.images import worst_case_images
from pretuner.presets.model import preset_line
from pretuner.report.records import (
    PinnedDerivation,
    RunReport,
    boots_words,
    device_words,
    kv_words,
)
from pretuner.tune.entry import DryRun
from pretuner.tune.pinned.report_sections import summary_lines
from pretuner.tune.report import SIM_NOTE, peak_words, step_cells

SIM_BANNER = f"*** {SIM_NOTE} ***"

def dry_run_json(d: DryRun, ray_address: str | None) -> dict[str, Any]:
    """`run --dry-run --json`: what the first launch would be, as data (secrets redacted)."""
    s, shown = d.setup, d.command.redacted()
    shape, soak = s.vision.images, s.vision.soak
    images = None  # a vision-language model's worst case and soak, as the run will send them
    if shape is not None:
        count, side = worst_case_images(shape, s.cfg.max_model_len, 1)
        images = {"image_limit": shape.image_limit, "worst_case_images": count,
                  "worst_case_image_px": [side, side], "tokens_per_image": shape.tokens_per_image,
                  "soak_requests": soak.requests, "soak_minutes": soak.minutes}
    return {
        "dry_run": True, "method": d.method.name, "engine": s.choice.name,
        "engine_reason": s.choice.reason, "simulated": s.choice.simulated,
        "card_gib": s.card.card_gib, "card_source": s.card.source, "free_mib": s.card.free_mib,
        "layout": s.layout_reason, "device_reader": _reader(d), "ray_address": ray_address,
        "first_launch": {"settings": d.prerun.to_json(), "argv": shown.argv, "env": shown.env},
        "images": images,
    }


def _reader(d: DryRun) -> str | None:
    reader = d.setup.ctx.device_reader
    return reader.name if reader else None


def render_dry_run(d: DryRun, ray_address: str | None) -> str:
    s, card = d.prerun, d.setup.card
    free = f"{card.free_mib:,} MiB" if card.free_mib is not None else "unknown"
    lines = [SIM_BANNER] if d.setup.choice.simulated else []
    lines += [
        f"engine: {d.setup.choice.name} ({d.setup.choice.reason})",
        f"card: {card.card_gib} GiB ({card.source}), free {free}",
        f"layout: {d.setup.layout_reason}",
        f"device reader: {_reader(d) or 'none'}",
        f"pre-run: {_prerun_kv(s)}, max_model_len {s.max_model_len:,}, "
        f"max-num-seqs {s.max_num_seqs}, max-num-batched-tokens {s.max_num_batched_tokens:,}",
        *_images_words(d),
        "launch 1 (pre-run) would be:",
        f"  {d.command.shell_line()}",
        f"then: {d.method.then}",
    ]
    if ray_address:
        lines.append(
            f"with --ray-address {ray_address}: pretuner first checks the cluster (nodes, NPUs, "
            "versions, node variables), then runs each launch with --distributed-executor-backend "
            "ray, RAY_ADDRESS, GLOG_logtostderr=0, GLOG_log_dir=<launch>/glog and these variables "
            "in the launch's Ray job runtime env, and reads every node's logs on that node.")
    return "\n".join(lines)


def _images_words(d: DryRun) -> list[str]:
    shape, soak_asked = d.setup.vision.images, d.setup.vision.soak
    if shape is None:
        return []
    if shape.is_text_only:
        return ["images: none (--limit-mm-per-prompt image=0): text-only requests"]
    count, side = worst_case_images(shape, d.setup.cfg.max_model_len, 1)
    soak = f"then a soak of {soak_asked.words()}" if soak_asked.on else "no soak (--soak 0)"
    return [f"images: the worst case carries {count} image(s) of {side}x{side} px "
            f"({shape.tokens_per_image:,} tokens each) through the chat API; validation: the "
            f"longest text prefill, the image burst, {soak}, the burst again"]


def _prerun_kv(s: LaunchSettings) -> str:
    if s.kv_cache_bytes is not None:
        return f"{s.kv_cache_bytes / 2**20:,.2f} MiB of KV pinned (one max-length sequence)"
    if s.model_use_gib:  # r0.1: the KV cache is what the two memory variables leave
        return f"util {s.util:g}, vLLM_MODEL_MEMORY_USE_GB {s.model_use_gib}"
    return f"util {s.util:g} (the engine profiles)"


def render_summary(rep: RunReport, record: Path) -> str:
    """The summary `pretuner run` prints of a finished run, either method."""
    f, d, tag = rep.final, rep.derivation, rep.provenance
    lines = [SIM_BANNER] if rep.simulated else []
    status = "VALIDATED under full load" if rep.validated else "NOT VALIDATED"
    if rep.validated and rep.given_up:
        status = f"VALIDATED, BUT LESS THAN ASKED ({'; '.join(rep.given_up)})"
    rows = [step_cells(s) for s in rep.steps]
    lines += [
        f"{rep.model} on {rep.engine}, {device_words(rep)}, TP{rep.tp} x PP{rep.pp}, "
        f"{rep.nodes} node(s): {status} after {rep.launches} launch(es){peak_words(rep)}",
        "",
        table(("#", "purpose", "KV", "max_model_len", "seqs", "outcome",
               f"worst peak MiB ({tag})", f"KV tokens ({tag})", "s"), rows),
        "",
    ]
    if isinstance(d, PinnedDerivation):
        lines += summary_lines(rep, d)
    lines.append(f"KV cache per card: {kv_words(rep)}")
    if (boots := boots_words(rep)) is not None:
        lines.append(boots)
    lines += [f"export {k}={v}" for k, v in f.env.items()]
    lines.append(shlex.join(f.serve_command))
    if f.engine_serve_command:
        lines.append("with the real engine (to be measured there): "
                     f"{shlex.join(f.engine_serve_command)}")
    lines.append(preset_line(rep.model, rep.card_gib, rep.tp, f.kv_tokens or 0, tag, rep.engine,
                             rep.model_arg))
    if (c := rep.cluster) is not None:  # where the ranks ran, and each launch's worst rank
        where = ", ".join(f"{n['node']}{' (this node)' if n['local'] else ''}: {n['ranks']} ranks"
                          for n in c["nodes"])
        worst = "; ".join(f"#{s.n} {s.worst_node}" for s in rep.steps if s.worst_node)
        what = "device" if any(s.node_peaks_mib for s in rep.steps) else "rank"  # V1: sampled
        lines.append(f"Ray cluster at {c['gcs_address']}: {where}; worst {what} on: "
                     f"{worst or '-'}")
    files = sorted(p.name for p in record.iterdir()
                   if p.is_file() and not p.name.startswith(".")
                   and p.name not in ("report.json", "journal.jsonl"))
    lines += ["", f"run record: {record}  ({', '.join(files)})"]
    return "\n".join(lines)
