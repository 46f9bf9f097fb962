"""How `pretuner run` shows a V1 engine's run and dry run."""

from __future__ import annotations

import shlex
from typing import Any

from pretuner.cli.render import table
from pretuner.engines.base import LaunchSettings
from pretuner.engines.registry import choose_engine
from pretuner.tune.entry import RunOptions
from pretuner.tune.v1.entry import V1RunOutcome, first_launch, v1_setup
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
                             "env": shown.env}}


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
        "first launch:",
        "  " + " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items()),
        "  " + shlex.join(cmd.argv),
    ]
    return "\n".join(lines)


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
