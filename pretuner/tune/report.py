"""The files a run leaves for people: report.json, report.md, tuned.env and serve.sh.

report.json is a typed record (`tune.records`) dumped as JSON; report.md and the scripts are
rendered from that record.

A run that fails (a `PretunerError`) leaves report.json and report.md too, with the reason, the
fix, every launch and every decision; never tuned.env or serve.sh.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pretuner import __version__
from pretuner.deploy.context import ScriptOptions
from pretuner.deploy.render import render_scripts
from pretuner.deploy.targets import Target
from pretuner.derivation_text import derivation_lines
from pretuner.engines.mindspore_r01 import chunked_prefill_flag, server_kv_cache_dtype
from pretuner.engines.outcome import LaunchOutcome
from pretuner.errors import ExitCode, PretunerError, ServerFailedError
from pretuner.plan.layout import PlanResult
from pretuner.presets.model import preset_from_report
from pretuner.redact import one_line, redact_argv
from pretuner.tune.asked import first_validation_seqs, given_up
from pretuner.tune.budget import outside_pool_mib
from pretuner.tune.loop import TuneResult
from pretuner.tune.records import (
    Asked,
    Decision,
    Derivation,
    FailureReport,
    Final,
    ReportProvenance,
    RunReport,
    Step,
    StepSettings,
)
from pretuner.units import GIB

# The outcome of a launch that raised before it had one (the server died at start, hung...).
UNFINISHED = "failed"


@dataclass(frozen=True, slots=True)
class RunMeta:
    """What a report says about the run besides the tuning: where and how it ran."""

    run_id: str
    backend: str
    simulated: bool
    card_source: str
    model_arg: str
    kv_cache_dtype: str = "auto"
    cluster: dict[str, Any] | None = None  # multi-node via Ray: the nodes and their ranks
    asked_max_model_len: int | None = None  # None: the final's
    retune_command: tuple[str, ...] = ()  # RunOptions.command_line()


def step_json(o: LaunchOutcome) -> Step:
    """One launch as report.json's `steps[]` shows it."""
    return Step(
        n=o.n,
        purpose=o.settings.purpose.value,
        settings=StepSettings(**o.settings.to_json()),
        outcome=o.kind.value,
        worst_peak_mib=o.worst_peak_mib,
        worst_node=o.worst_node,
        rank_peaks_mib=o.rank_peaks_mib,
        device_reader=o.device_reader,
        device_peaks_mib=o.device_peaks_mib,
        requests_ok=o.requests_ok,
        requests_total=o.requests_total,
        oom_text=o.oom_text,
        seconds=o.total_s,
        overhead_s=o.overhead_s,
        log=o.log_path,
    )


def unfinished_step(n: int, settings: dict[str, Any], log: str | None) -> Step:
    """A launch that raised before it had an outcome (`settings` as the journal has them);
    nothing was measured."""
    return Step(
        n=n,
        purpose=settings["purpose"],
        settings=StepSettings.model_validate(settings),
        outcome=UNFINISHED,
        worst_peak_mib=None,
        worst_node=None,
        rank_peaks_mib={},
        device_reader=None,
        device_peaks_mib={},
        requests_ok=None,
        requests_total=None,
        oom_text=None,
        seconds=None,
        overhead_s=None,
        log=log,
    )


def _run_fields(
    meta: RunMeta,
    p: PlanResult,
    steps: Sequence[Step],
    decisions: Iterable[Decision],
) -> dict[str, Any]:
    """The fields a success and a failure report share, in report.json's order."""
    return {
        "pretuner_version": __version__,
        "run_id": meta.run_id,
        "backend": meta.backend,
        "simulated": meta.simulated,
        "model": p.model,
        "model_arg": meta.model_arg,
        "card_gib": p.card_gib,
        "card_source": meta.card_source,
        "tp": p.tp,
        "pp": p.pp,
        "nodes": p.nodes,
        "weights_format": p.weights_format,
        "kv_cache_dtype": meta.kv_cache_dtype,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "launches": len(steps),
        "steps": list(steps),
        "decisions": list(decisions),
    }


def report_json(result: TuneResult, meta: RunMeta, serve_command: list[str]) -> RunReport:
    """The record of a finished run; report.json is its `model_dump(mode="json")`."""
    d, p = result.derivation, result.plan
    f = d.final
    asked_len = meta.asked_max_model_len or f.max_model_len
    asked_seqs = first_validation_seqs(result.outcomes)
    flags: dict[str, Any] = {**f.flags, "tensor_parallel_size": p.tp}
    if p.pp > 1:
        flags["pipeline_parallel_size"] = p.pp
    chunk_flag = chunked_prefill_flag(f.max_model_len, f.chunked_prefill)
    if chunk_flag is not None:
        flags["enable_chunked_prefill"] = chunk_flag
    server_dtype = server_kv_cache_dtype(meta.kv_cache_dtype)
    if server_dtype is not None:
        flags["kv_cache_dtype"] = server_dtype
    return RunReport(
        **_run_fields(meta, p, [step_json(o) for o in result.outcomes], result.decisions),
        validated=result.validated,
        derivation=Derivation(
            kv_prerun_gib=round(d.kv_prerun_gib, 4),
            actual_peak_mib=d.actual_peak_bytes // 2**20,
            weights_act_gib=round(d.weights_act_gib, 4),
            headroom_gib=d.inputs.headroom_gib,
            headroom_total_gib=round(d.headroom_total_gib, 4),
            rounding_cost_gib=round(d.rounding_cost_bytes / GIB, 4),
            final_util_source=result.final_util_source,
        ),
        final=Final(
            env=f.env,
            flags=flags,
            serve_command=redact_argv(serve_command),  # serve.sh reads a secret from env
        ),
        max_kv_tokens=f.kv_tokens,
        max_kv_gib=round(f.kv_bytes / GIB, 4),
        provenance=ReportProvenance(
            actual_peak_mib="simulated" if meta.simulated else "measured", final="derived"
        ),
        asked=Asked(max_model_len=asked_len, max_num_seqs=asked_seqs),
        given_up=given_up(asked_len, asked_seqs, f.max_model_len, f.max_num_seqs,
                          seqs_from="derived from the pre-run"),
        retune_command=list(meta.retune_command),
        cluster=meta.cluster,
    )


def failure_json(
    err: PretunerError,
    meta: RunMeta,
    p: PlanResult,
    steps: Sequence[Step],
    decisions: Iterable[Decision],
) -> FailureReport:
    """The record of a run stopped by `err`: why, the fix, and everything done until then."""
    return FailureReport(
        **_run_fields(meta, p, steps, decisions),
        validated=False,
        error=err.message,
        hint=err.hint,
        exit_code=int(err.exit_code),
        error_type=type(err).__name__,
        server_log=err.log_path if isinstance(err, ServerFailedError) else None,
        cluster=meta.cluster,
    )


def report_md(rep: RunReport, result: TuneResult) -> str:
    d = result.derivation
    status = "validated under full load" if rep.validated else "NOT validated"
    if rep.validated and rep.given_up:
        status += f", but less than asked: {'; '.join(rep.given_up)} (exit 9)"
    lines = [
        f"# pretuner run {one_line(rep.run_id)}",
        "",
        *_run_lines(rep),
        f"- result: {status} after {rep.launches} launch(es)",
        f"- KV cache per card: {rep.max_kv_gib:.2f} GiB = {rep.max_kv_tokens:,} tokens",
        *_cluster_lines(rep),
        *_launch_lines(rep),
        "",
        "## Derivation",
        "",
        "```",
    ]
    lines += derivation_lines(d, card_source=rep.card_source,
                              provenance="simulated" if rep.simulated else "measured")
    lines += ["```", "", "## Memory per card (worst rank)", ""]
    f = d.final
    cap_gib = f.ascend_total_memory_gb * f.gpu_memory_utilization
    tag = "simulated" if rep.simulated else "measured"
    lines += [
        "| part | GiB | provenance |",
        "|---|---|---|",
        f"| weights + activations (pre-run) | {d.weights_act_gib:.2f} | derived from the peak |",
        f"| headroom (base + per sequence) | {d.headroom_total_gib:.2f} | given + derived |",
        f"| rounding to integer model-use | {d.rounding_cost_bytes / GIB:.2f} | derived |",
        f"| KV cache | {f.kv_bytes / GIB:.2f} | derived |",
        f"| pool cap (card x util) | {cap_gib:.2f} | derived |",
        *_proof_rows(result.validation, cap_gib, tag, result.pool_on_demand),
        "",
        "## Start the server",
        "",
        "```sh",
        "./serve.sh   # or: set -a; . ./tuned.env; set +a",
        "```",
        "",
        f"Re-tune: `{shlex.join(rep.retune_command)}`",
    ]
    return "\n".join(lines) + "\n"


def _proof_rows(
    validation: LaunchOutcome | None, cap_gib: float, tag: str, on_demand: bool
) -> list[str]:
    """What the validation left below the cap, and what the device held outside the pool."""
    if validation is None or validation.worst_peak_mib is None:
        return ["| validation margin (cap - worst-rank peak under load) | - | no validation |"]
    peak = validation.worst_peak_mib / 1024
    rows = [f"| validation margin (cap - worst-rank peak under load) | {cap_gib - peak:.2f} | "
            f"{tag} peak {validation.worst_peak_mib:,} MiB |"]
    device = max(validation.device_peaks_mib.values(), default=None)
    total, free = validation.device_total_mib, validation.device_free_mib
    if device is None:
        rows.append("| outside the pool (device peak - pool peak) | - | no device reader |")
    elif on_demand:
        rows.append("| outside the pool | - | not told apart: MindSpore's pool grows on demand "
                    f"(enable_vmm); {tag}: device peak {device:,} MiB |")
    elif total is None or free is None:
        rows.append(f"| outside the pool (device peak - pool peak) | {device / 1024 - peak:.2f} "
                    f"| {tag}: device {device:,} MiB ({validation.device_reader}) |")
    else:
        # MindSpore takes its whole pool at start: what the device held beyond that and what
        # was in use when it read the free memory came after, from other components.
        cap_mib = cap_gib * 1024
        after = outside_pool_mib(device, total, free, cap_mib)
        rows += [
            f"| in use before the pool (device total - free at MindSpore's init) | "
            f"{(total - free) / 1024:.2f} | {tag}: {total:,} MiB ({validation.device_reader}) "
            f"- {free:,} MiB free (init line) |",
            f"| outside the pool after init (device peak - that - pool cap) | {after / 1024:.2f} "
            f"| {tag}: device peak {device:,} MiB |",
        ]
    return rows


def failure_md(rep: FailureReport) -> str:
    """report.md of a failed run (`failure_json`): the reason and the fix first."""
    code = rep.exit_code
    reason, _, details = rep.error.partition("\n")  # a server failure adds its log tail
    lines = [
        f"# pretuner run {one_line(rep.run_id)}: FAILED (exit {code}, {_exit_name(code)})",
        "",
        f"- reason: {reason}",
        f"- fix: {rep.hint or 'read the server log and the decisions below'}",
    ]
    if rep.server_log:
        lines.append(f"- server log: {rep.server_log}")
    lines += [
        "",
        *_run_lines(rep),
        f"- result: NOT validated, stopped after {rep.launches} launch(es); no tuned.env or "
        "serve.sh was written",
        *_cluster_lines(rep),
        *_launch_lines(rep),
    ]
    if details:
        lines += ["", "## Details", "", "```", details.rstrip("\n"), "```"]
    lines += [
        "",
        f"Re-run after the fix: `pretuner run --model {rep.model_arg} --card {rep.card_gib}`"
        " with the options the fix names",
    ]
    return "\n".join(lines) + "\n"


def _exit_name(code: int) -> str:
    try:
        return ExitCode(code).name.lower().replace("_", " ")
    except ValueError:
        return "error"


def _run_lines(rep: RunReport | FailureReport) -> list[str]:
    tag = "SIMULATED (emulated card)" if rep.simulated else "measured"
    return [
        f"- model: {rep.model} ({rep.weights_format}), TP{rep.tp} x PP{rep.pp} on "
        f"{rep.nodes} node(s)",
        f"- card: {rep.card_gib} GiB ({rep.card_source}); backend {rep.backend}; "
        f"figures {tag}",
    ]


def _launch_lines(rep: RunReport | FailureReport) -> list[str]:
    """The launch table and the decisions, as both a success and a failure report show them."""
    lines = ["", "## Launches", ""]
    if rep.steps:
        lines += [
            "| # | purpose | util | model-use GiB | max_model_len | max-num-seqs | outcome | "
            "worst peak MiB | seconds |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines.append("No launch was made.")
    for s in rep.steps:
        st = s.settings
        peak = f"{s.worst_peak_mib:,}" if s.worst_peak_mib else "-"
        if s.worst_node:
            peak += f" on {s.worst_node}"
        seconds = "-" if s.seconds is None else f"{s.seconds:.1f}"
        lines.append(
            f"| {s.n} | {s.purpose} | {st.util} | {st.model_use_gib} | "
            f"{st.max_model_len:,} | {st.max_num_seqs} | {s.outcome} | {peak} | "
            f"{seconds} |"
        )
    lines += ["", "## Decisions", ""]
    lines += [f"- **{x['decision']}**: {x['reason']}" for x in rep.decisions]
    return lines


def _cluster_lines(rep: RunReport | FailureReport) -> list[str]:
    if rep.cluster is None:
        return []
    c = rep.cluster
    nodes = ", ".join(f"{n['node']} ({n['ranks']} ranks)" for n in c["nodes"])
    return [
        f"- Ray cluster at {c['gcs_address']}: {nodes}; every node's logs scanned on that node"
    ]


def tuned_env(rep: RunReport, result: TuneResult | None) -> str:
    """The run's environment alone, rendered from templates/tuned.env.j2."""
    return _render(rep, Target.ENV, "tuned.env")


def serve_sh(rep: RunReport, result: TuneResult | None) -> str:
    """The run's own server command (the emulated one on a simulated run) with the tuned values."""
    return _render(rep, Target.SERVE, "serve.sh")


def _render(rep: RunReport, target: Target, name: str) -> str:
    # Presets read report.json files (`pretuner preset add`), so they get the JSON form.
    preset = preset_from_report(rep.model_dump(mode="json"), date="-")
    status = "validated under full load" if rep.validated else "NOT validated"
    # The header line `# run <id>: <status>` is built and made one line by the script context.
    opts = ScriptOptions(command=tuple(rep.final.serve_command), status=status)
    return render_scripts(preset, opts, [target])[name]
