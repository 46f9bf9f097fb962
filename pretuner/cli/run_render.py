"""What `pretuner run` prints for the r0.1 method: the dry run (text and JSON) and the summary
of a finished run."""

from __future__ import annotations

from typing import Any

from pretuner.cli.render import table
from pretuner.presets.compare import preset_line
from pretuner.tune.entry import DryRun, RunOutcome
from pretuner.tune.records import Cluster, Step
from pretuner.units import GIB

SIM_BANNER = (
    "*** EMULATED CARD: no Ascend stack here, so pretuner drives its emulated vLLM-MindSpore "
    "server. Every figure below is SIMULATED, not measured. ***"
)

RAY_DRY_RUN = (
    "with --ray-address {address}: pretuner first checks the cluster (nodes, NPUs, versions, "
    "node variables), then runs each launch with --distributed-executor-backend ray, "
    "RAY_ADDRESS, GLOG_logtostderr=0, GLOG_log_dir=<launch>/glog and these variables in the "
    "launch's Ray job runtime env, and reads every node's logs on that node."
)


def dry_run_json(d: DryRun, ray_address: str | None) -> dict[str, Any]:
    """`run --dry-run --json` for the r0.1 method: what the first launch would be, as data."""
    shown = d.command.redacted()
    return {
        "dry_run": True,
        "method": "r0.1",
        "engine": d.engine.name,
        "engine_reason": d.engine.reason,
        "backend": d.engine.server,  # what serves (report.json's `backend`)
        "simulated": d.engine.simulated,
        "card_gib": d.card.card_gib,
        "card_source": d.card.source,
        "free_mib": d.card.free_mib,
        "layout": d.layout_reason,
        "ray_address": ray_address,
        "first_launch": {"settings": d.prerun.to_json(), "argv": shown.argv, "env": shown.env},
    }


def render_dry_run(d: DryRun) -> str:
    lines = []
    if d.engine.simulated:
        lines.append(SIM_BANNER)
    lines += [
        f"engine: {d.engine.name} ({d.engine.reason})",
        f"card: {d.card.card_gib} GiB ({d.card.source}), free "
        + (f"{d.card.free_mib:,} MiB" if d.card.free_mib is not None else "unknown"),
        f"layout: {d.layout_reason}",
        "launch 1 (pre-run) would be:",
        f"  {d.command.shell_line()}",
        "then: read every rank's `actual peak used` after a graceful stop, derive, and validate "
        "with max-num-seqs concurrent max-length requests (launch 2).",
    ]
    return "\n".join(lines)


def render_summary(o: RunOutcome) -> str:
    rep = o.report
    f = o.result.derivation.final
    lines = []
    if rep.simulated:
        lines.append(SIM_BANNER)
    status = "VALIDATED under full load" if rep.validated else "NOT VALIDATED"
    if rep.validated and rep.given_up:
        status = f"VALIDATED, BUT LESS THAN ASKED ({'; '.join(rep.given_up)})"
    tag = rep.provenance.actual_peak_mib
    rows = [
        (s.n, s.purpose, s.settings.util, s.settings.model_use_gib,
         f"{s.settings.max_model_len:,}", s.settings.max_num_seqs, s.outcome,
         f"{s.worst_peak_mib:,}" if s.worst_peak_mib else "-",
         "-" if s.seconds is None else f"{s.seconds:.1f}")
        for s in rep.steps
    ]  # fmt: skip
    lines += [
        f"{rep.model} on {rep.card_gib} GiB cards, TP{rep.tp} x PP{rep.pp}, "
        f"{rep.nodes} node(s): {status} after {rep.launches} launch(es)",
        "",
        table(
            (
                "#",
                "purpose",
                "util",
                "model-use GiB",
                "max_model_len",
                "seqs",
                "outcome",
                f"worst peak MiB ({tag})",
                "s",
            ),
            rows,
        ),  # fmt: skip
        "",
        f"KV cache per card: {f.kv_bytes / GIB:.2f} GiB = {f.kv_tokens:,} tokens (derived)",
    ]
    lines += [f"export {k}={v}" for k, v in f.env.items()]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in rep.final.flags.items())
    lines += [flags, preset_line(rep.model, rep.card_gib, rep.tp, f.kv_tokens, tag)]
    if rep.cluster is not None:
        lines.append(cluster_line(rep.cluster, rep.steps))
    lines += ["", f"run record: {o.record}  (report.md, report.html, tuned.env, serve.sh)"]
    return "\n".join(lines)


def cluster_line(c: Cluster, steps: list[Step]) -> str:
    """Where the ranks ran and where each launch's worst rank was."""
    where = ", ".join(
        f"{n['node']}{' (this node)' if n['local'] else ''}: {n['ranks']} ranks" for n in c["nodes"]
    )
    worst = "; ".join(f"#{s.n} {s.worst_node}" for s in steps if s.worst_node)
    return f"Ray cluster at {c['gcs_address']}: {where}; worst rank on: {worst or '-'}"
