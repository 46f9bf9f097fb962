"""The files a run leaves for people, on every engine: report.json (one typed `RunReport`),
report.md from the record alone (a method adds its own sections, `tune.pinned.report_sections`),
and the startup files `pretuner script RUN` writes. Every figure says its provenance. A failed
run leaves report.json and report.md with the reason and the fix, never startup files; a Ctrl-C
writes none of this (the run stays resumable).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from pretuner import __version__, noise
from pretuner.deploy.context import ScriptOptions
from pretuner.deploy.render import run_scripts
from pretuner.deploy.targets import Target
from pretuner.derivation_text import derivation_lines
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.mindspore_r01 import R01_COMMAND, R01Engine, graph_cache_env
from pretuner.engines.outcome import PHASE_WORDS, LaunchOutcome, peak_phase
from pretuner.engines.stack import stack_words
from pretuner.errors import ExitCode, PretunerError, ServerFailedError
from pretuner.launch.command import deployed_port, wrapped
from pretuner.models import folder_identity, local_model_path, resolve
from pretuner.plan.layout import PlanResult
from pretuner.redact import one_line, redact_argv
from pretuner.report.html.page import refresh_run_page
from pretuner.report.records import (
    AnyReport,
    Asked,
    Boots,
    Decision,
    FailureReport,
    Final,
    ProofPeak,
    Provenance,
    R01Derivation,
    RunReport,
    Step,
    StepSettings,
    V1Speed,
    boots_words,
    decision_text,
    device_words,
    kv_words,
)
from pretuner.report.records import Method as MethodName
from pretuner.tune.pinned.report_sections import pinned_sections
from pretuner.tune.r01.budget import outside_pool_mib
from pretuner.tune.r01.config import TuneResult
from pretuner.tune.record import RunRecord
from pretuner.units import GIB

if TYPE_CHECKING:
    from pretuner.tune.setup import Method

log = logging.getLogger(__name__)
# The outcome of a launch that raised before it had one (the server died at start, hung...).
UNFINISHED = "failed"
SIM_NOTE = ("EMULATED: no real engine or device ran here: pretuner drove its emulated server "
            "on an emulated card, so every figure is SIMULATED, not measured.")


def provenance(simulated: bool) -> Provenance:
    return "simulated" if simulated else "measured"


@dataclass(frozen=True, slots=True)
class RunMeta:
    """What a report says about a run besides the tuning: where and how it ran."""

    run_id: str
    engine: str  # the report's name: sim, vllm-mindspore, vllm...
    simulated: bool
    card_source: str
    model_arg: str  # what the server loads
    kv_cache_dtype: str = "auto"
    cluster: dict[str, Any] | None = None  # multi-node via Ray: the nodes and their ranks
    asked_max_model_len: int | None = None  # None: the final's
    retune_command: tuple[str, ...] = ()  # RunOptions.command_line()
    engine_version: str | None = None
    engine_reason: str = ""
    device_kind: str = "ascend"
    stack: dict[str, str] | None = None  # pretuner.engines.stack; None: not recorded
    device_name: str | None = None  # as the device tool names the first device
    engine_python: str | None = None  # the interpreter of an engine in its own venv


# The figures a step keeps under the outcome's own names.
_SAME = [name for name in Step.model_fields
         if name in {f.name for f in fields(LaunchOutcome)} - {"settings", "speed"}]


def step_json(o: LaunchOutcome) -> Step:
    """One launch as report.json's `steps[]` shows it."""
    return Step(
        **{name: getattr(o, name) for name in _SAME}, purpose=o.settings.purpose.value,
        settings=StepSettings(**o.settings.to_json()), outcome=o.kind.value, seconds=o.total_s,
        log=o.log_path, speed=V1Speed(**o.speed.to_json()) if o.speed is not None else None,
    )


def unfinished_step(n: int, settings: dict[str, Any], log: str | None) -> Step:
    """A launch that raised before it had an outcome (`settings` as the journal has them);
    nothing was measured."""
    return Step(
        n=n, purpose=settings["purpose"], settings=StepSettings.model_validate(settings),
        outcome=UNFINISHED, worst_peak_mib=None, worst_node=None, rank_peaks_mib={},
        device_reader=None, device_peaks_mib={}, requests_ok=None, requests_total=None,
        oom_text=None, seconds=None, overhead_s=None, log=log,
    )


def given_up(asked_len: int, asked_seqs: int | None, final_len: int, final_seqs: int, *,
             seqs_from: str = "asked") -> list[str]:
    """One line per cut: "max_model_len 11,264 < 16,384 asked"."""
    cuts = []
    if final_len < asked_len:
        cuts.append(f"max_model_len {final_len:,} < {asked_len:,} asked")
    if asked_seqs is not None and final_seqs < asked_seqs:
        cuts.append(f"max-num-seqs {final_seqs} < {asked_seqs} {seqs_from}")
    return cuts


def run_head(meta: RunMeta, steps: Sequence[Step], decisions: Iterable[Decision],
             validated: bool, **layout: Any) -> dict[str, Any]:
    """The fields a success and a failure report share, on any engine; `layout` names the
    model, card_gib, tp, pp, nodes, weights_format and kv_bytes_per_token."""
    said = {k: v for k, v in asdict(meta).items() if k != "asked_max_model_len"}
    folder = folder_identity(meta.model_arg)
    return {**said, "model_folder": asdict(folder) if folder else None,
            "pretuner_version": __version__, "provenance": provenance(meta.simulated),
            "validated": validated, "launches": len(steps), "steps": list(steps),
            "decisions": list(decisions), "retune_command": list(meta.retune_command), **layout}


def real_model(meta: RunMeta, model: str) -> str:
    """What the real engine loads: the folder, else the Hugging Face id (not the registry's
    name an emulated server took)."""
    return local_model_path(meta.model_arg) or resolve(model).hf_id


def plan_layout(p: PlanResult) -> dict[str, Any]:
    return {"model": p.model, "card_gib": p.card_gib, "tp": p.tp, "pp": p.pp, "nodes": p.nodes,
            "weights_format": p.weights_format, "kv_bytes_per_token": p.kv_bytes_per_token}


def report_json(result: TuneResult, meta: RunMeta, engine: R01Engine) -> RunReport:
    """The record of a finished r0.1 run; report.json is its `model_dump(mode="json")`."""
    d, p = result.derivation, result.plan
    f = d.final
    tag = provenance(meta.simulated)
    asked_len = meta.asked_max_model_len or f.max_model_len
    # The method's promise: the sequences its first validation was derived to serve.
    asked_seqs = next((o.settings.max_num_seqs for o in result.outcomes
                       if o.settings.purpose is Purpose.VALIDATE), None)
    deployment = engine.deploy(LaunchSettings(
        Purpose.VALIDATE, f.ascend_total_memory_gb, f.gpu_memory_utilization,
        f.vllm_model_memory_use_gb, f.max_model_len, f.max_num_seqs, f.max_num_batched_tokens,
        f.block_size, p.tp, p.pp, meta.kv_cache_dtype, f.chunked_prefill))
    flags = deployment.argv()
    serve = engine.serve_argv(meta.model_arg)
    # An emulated card's run: what the real engine would run (`script` writes it).
    real = [*R01_COMMAND, "--model", real_model(meta, p.model), *flags]
    cap_gib = f.ascend_total_memory_gb * f.gpu_memory_utilization
    return RunReport(
        **run_head(meta, [step_json(o) for o in result.outcomes], result.decisions,
                   result.validated, **plan_layout(p)),
        final=Final(
            # the graph cache every launch had (pretuner.engines.mindspore_r01), production's too
            env={**f.env, **graph_cache_env(engine.launch_env)}, flags=flags,
            # serve.sh reads a secret; a wrapper publishes the port the server listens on
            serve_command=redact_argv(wrapped([*serve, *flags], deployed_port(flags),
                                              deployment.env)),
            engine_serve_command=real if meta.simulated and not engine.serve_cmd else None,
            notes=[], max_model_len=f.max_model_len,
            max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
            kv_tokens=f.kv_tokens, kv_gib=round(f.kv_bytes / GIB, 4),
        ),
        derivation=R01Derivation(
            kv_prerun_gib=round(d.kv_prerun_gib, 4), actual_peak_mib=d.actual_peak_bytes // 2**20,
            weights_act_gib=round(d.weights_act_gib, 4), headroom_gib=d.inputs.headroom_gib,
            headroom_total_gib=round(d.headroom_total_gib, 4),
            rounding_cost_gib=round(d.rounding_cost_bytes / GIB, 4),
            final_util_source=result.final_util_source, util=f.gpu_memory_utilization,
            lines=derivation_lines(d, card_source=meta.card_source, provenance=tag),
            memory_rows=[
                f"weights + activations (pre-run) | {d.weights_act_gib:.2f} | derived from "
                f"the {tag} peak",
                f"headroom (base + per sequence) | {d.headroom_total_gib:.2f} | given + derived",
                f"rounding to integer model-use | {d.rounding_cost_bytes / GIB:.2f} | derived",
                f"KV cache | {f.kv_bytes / GIB:.2f} | derived",
                f"pool cap (card x util) | {cap_gib:.2f} | derived",
                *_proof_rows(result.validation, cap_gib, tag, result.pool_on_demand),
            ],
        ),
        asked=Asked(max_model_len=asked_len, max_num_seqs=asked_seqs),
        given_up=given_up(asked_len, asked_seqs, f.max_model_len, f.max_num_seqs,
                          seqs_from="derived from the pre-run"),
        peak=proof_peak(result.validation) if result.validated else None,
        boots=boots_record(result.boot_peaks_mib, round(cap_gib * 1024), p.card_gib * 1024),
    )


def boots_record(peaks: tuple[int, ...], cap_mib: int, total_mib: int) -> Boots | None:
    """The final configuration's boots (--repeat-proof): each proof peak against the cap it
    must stay under (r0.1: the pool; V1: the device), the floor scaled to `total_mib`."""
    if len(peaks) < 2:
        return None
    spread = noise.spread_mib(peaks)
    return Boots(peaks_mib=list(peaks), spread_mib=spread, headroom_mib=cap_mib - max(peaks),
                 floor_mib=noise.floor_mib(total_mib, spread))


def _proof_rows(
    validation: LaunchOutcome | None, cap_gib: float, tag: str, on_demand: bool
) -> list[str]:
    """What the validation left below the cap, and what the device held outside the pool."""
    if validation is None or validation.worst_peak_mib is None:
        return ["validation margin (cap - worst-rank peak under load) | - | no validation"]
    peak = validation.worst_peak_mib / 1024
    rows = [f"validation margin (cap - worst-rank peak under load) | {cap_gib - peak:.2f} | "
            f"{tag} peak {validation.worst_peak_mib:,} MiB"]
    device = max(validation.device_peaks_mib.values(), default=None)
    total, free = validation.device_total_mib, validation.device_free_mib
    if device is None:
        rows.append("outside the pool (device peak - pool peak) | - | no device reader")
    elif on_demand:
        rows.append("outside the pool | - | not told apart: MindSpore's pool grows on demand "
                    f"(enable_vmm); {tag}: device peak {device:,} MiB")
    elif total is None or free is None:
        rows.append(f"outside the pool (device peak - pool peak) | {device / 1024 - peak:.2f} "
                    f"| {tag}: device {device:,} MiB ({validation.device_reader})")
    else:
        # MindSpore takes its whole pool at start: what the device held beyond that and what
        # was in use when it read the free memory came after, from other components.
        after = outside_pool_mib(device, total, free, cap_gib * 1024)
        rows += [
            f"in use before the pool (device total - free at MindSpore's init) | "
            f"{(total - free) / 1024:.2f} | {tag}: {total:,} MiB ({validation.device_reader}) "
            f"- {free:,} MiB free (init line)",
            f"outside the pool after init (device peak - that - pool cap) | {after / 1024:.2f} "
            f"| {tag}: device peak {device:,} MiB",
        ]
    return rows


def failure_json(err: PretunerError, meta: RunMeta, steps: Sequence[Step],
                 decisions: Iterable[Decision], method: MethodName, **layout: Any) -> FailureReport:
    """The record of a run stopped by `err`, either method: why, the fix, and everything done."""
    return FailureReport(
        **run_head(meta, steps, decisions, False, **layout), method=method, error=err.message,
        hint=err.hint, exit_code=int(err.exit_code), error_type=type(err).__name__,
        server_log=err.log_path if isinstance(err, ServerFailedError) else None)


# -- report.md ------------------------------------------------------------------------------------


def proof_peak(o: LaunchOutcome | None) -> ProofPeak | None:
    """Which phase of the proving launch `o` set its device peak (None: nothing sampled)."""
    phase = peak_phase(o.device_peaks_mib) if o is not None else None
    if o is None or phase is None:
        return None
    return ProofPeak(launch=o.n, phase=phase, what=PHASE_WORDS.get(phase, phase),
                     peak_mib=o.device_peaks_mib[phase], device_reader=o.device_reader)


def peak_words(rep: RunReport) -> str:
    """`; device peak 81,136 MiB (simulated), set by the short burst (...) in launch 4`."""
    p = rep.peak
    if p is None:
        return ""
    return (f"; device peak {p.peak_mib:,} MiB ({rep.provenance}), set by {p.what} in "
            f"launch {p.launch}")


def proof_lines(rep: RunReport) -> list[str]:
    """report.md's proof: the proving launch's device peak in each phase, in order."""
    p = rep.peak
    step = next((s for s in rep.steps if p is not None and s.n == p.launch), None)
    if p is None or step is None:
        return []
    lines = [f"## Proof: device peak by phase (launch {p.launch}, MiB, {rep.provenance}, "
             f"read by {p.device_reader})", ""]
    for phase, mib in step.device_peaks_mib.items():
        mark = " **(the peak)**" if phase == p.phase else ""
        lines.append(f"- {phase}: {mib:,}, {PHASE_WORDS.get(phase, phase)}{mark}")
    return [*lines, ""]


def status_words(rep: RunReport) -> str:
    """`validated under full load`, with what was given up against the ask (exit 9)."""
    if not rep.validated:
        return "NOT validated"
    words = "validated under full load"
    return words + (f", but less than asked: {'; '.join(rep.given_up)} (exit 9)"
                    if rep.given_up else "")


def _run_lines(rep: AnyReport) -> list[str]:
    """Where and how the run ran: the same lines for a success and a failure."""
    lines = [f"> {SIM_NOTE}", ""] if rep.simulated else []
    version = f" {rep.engine_version}" if rep.engine_version else ""
    lines += [
        f"- engine: {rep.engine}{version} ({one_line(rep.engine_reason) or 'as asked'})",
        f"- model: {rep.model} ({rep.weights_format}, `{one_line(rep.model_arg)}`), "
        f"TP{rep.tp} x PP{rep.pp} on {rep.nodes} node(s), {device_words(rep)}",
        f"- fingerprint (serve.sh checks it): {stack_words(rep.stack)}"
        f"{'' if rep.stack is None else ' (read from the engine Python)'}; device "
        f"{rep.device_name or 'name not recorded'}"
        f"{'' if rep.device_name is None else ' (as its tool names it)'}",
    ]
    if (f := rep.model_folder) is not None:
        named = f"; its config.json names {f.hub_id}" if f.hub_id else ""
        lines.append(f"- model folder: `{one_line(f.path)}`, config.json sha256 "
                     f"{f.config_sha256}{named} (served by this path, never by a hub id)")
    if rep.cluster is not None:
        c = rep.cluster
        # A run that sampled every node's devices (V1) shows each node's peak of its last launch
        peaks = next((s.node_peaks_mib for s in reversed(rep.steps) if s.node_peaks_mib), {})
        nodes = ", ".join(
            f"{n['node']} ({n['ranks']} ranks"
            + (f", peak {peaks[n['node']]:,} MiB {rep.provenance}"
               if n["node"] in peaks else "") + ")"
            for n in c["nodes"])
        how = "devices sampled" if peaks else "logs scanned"
        lines.append(f"- Ray cluster at {c['gcs_address']}: {nodes}; every node's {how} on "
                     f"that node{' (last launch)' if peaks else ''}")
    return lines


def report_md(rep: RunReport) -> str:
    """report.md of a finished run, either method."""
    f, d = rep.final, rep.derivation
    lines = [f"# pretuner run {one_line(rep.run_id)}: "
             f"{'VALIDATED' if rep.validated else 'NOT VALIDATED'}", "", *_run_lines(rep),
             f"- result: {status_words(rep)} after {rep.launches} launch(es){peak_words(rep)}",
             f"- KV cache per card: {kv_words(rep)}",
             f"- max_model_len {f.max_model_len:,}, max-num-seqs {f.max_num_seqs}, "
             f"max-num-batched-tokens {f.max_num_batched_tokens:,}"]
    if (boots := boots_words(rep)) is not None:
        lines.append(f"- {boots}")
    lines.append("")
    lines += proof_lines(rep)
    if isinstance(d, R01Derivation):
        lines += ["## Derivation", "", "```", *d.lines, "```", "",
                  "## Memory per card (worst rank)", "", "| part | GiB | how |", "|---|---|---|",
                  *[f"| {row} |" for row in d.memory_rows], ""]
    else:
        lines += pinned_sections(rep, d)
    lines += launch_lines(rep)
    lines += ["", "## Start production", "", "```sh",
              "./serve.sh" + ("   # or: set -a; . ./tuned.env; set +a" if f.env else ""),
              "```", ""]
    lines += [f"- {note}" for note in f.notes] + ([""] if f.notes else [])
    if f.engine_serve_command:
        lines += ["The figures above are simulated; serve.sh starts the real engine with the "
                  "same flags (run `pretuner run` on a real device to measure and prove them):",
                  "", "```sh", shlex.join(f.engine_serve_command), "```", ""]
    if rep.retune_command:
        lines += [f"Re-tune: `{shlex.join(rep.retune_command)}`", ""]
    return "\n".join(lines)


def failure_md(rep: FailureReport) -> str:
    """report.md of a failed run: the reason and the fix first."""
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
    lines += ["", *_run_lines(rep),
              f"- result: NOT validated, stopped after {rep.launches} launch(es); no tuned.env or "
              "serve.sh was written", *launch_lines(rep)]
    if details:
        lines += ["", "## Details", "", "```", details.rstrip("\n"), "```"]
    again = rep.retune_command or ["pretuner", "run", "--model", rep.model_arg, "--card",
                                   str(rep.card_gib)]
    lines += ["", f"Re-run after the fix: `{shlex.join(again)}` with the options the fix names"]
    return "\n".join(lines) + "\n"


def _exit_name(code: int) -> str:
    try:
        return ExitCode(code).name.lower().replace("_", " ")
    except ValueError:
        return "error"


def kv_asked(s: Step) -> str:
    """How a launch sized its KV cache: pinned bytes, r0.1's model-use, or the engine's util."""
    st = s.settings
    if st.kv_cache_bytes:
        return f"{st.kv_cache_bytes / GIB:.2f} GiB pinned"
    if st.model_use_gib:
        return f"util {st.util}, model-use {st.model_use_gib} GiB"
    return f"util {st.util}"


def step_cells(s: Step, node: bool = False) -> list[str]:
    """A launch as a row of the launch table (report.md, the run summary); its peak is the
    worst rank's pool (r0.1's logs), else the sampled device's."""
    peak = s.worst_peak_mib if s.worst_peak_mib is not None else max(
        s.device_peaks_mib.values(), default=None)
    shown = (f"{peak:,}" if peak else "-") + (f" on {s.worst_node}" if node and s.worst_node
                                               else "")
    return [str(s.n), s.purpose, kv_asked(s), f"{s.settings.max_model_len:,}",
            str(s.settings.max_num_seqs), s.outcome, shown,
            f"{s.kv_tokens:,}" if s.kv_tokens else "-",
            "-" if s.seconds is None else f"{s.seconds:.1f}"]


def launch_lines(rep: AnyReport) -> list[str]:
    """The launch table and the decisions, as both a success and a failure report show them."""
    lines = ["", "## Launches", ""]
    if rep.steps:
        lines += ["| # | purpose | KV asked | max_model_len | max-num-seqs | outcome | "
                  f"peak MiB ({rep.provenance}) | KV tokens | seconds |",
                  "|---|---|---|---|---|---|---|---|---|"]
    else:
        lines.append("No launch was made.")
    lines += [f"| {' | '.join(step_cells(s, node=True))} |" for s in rep.steps]
    if any(s.compile_cache in ("cold", "warm", "off") for s in rep.steps):
        lines += ["", "Compile cache at launch: " + ", ".join(
            f"#{s.n} {s.compile_cache or 'not recorded'}" for s in rep.steps)]
    lines += ["", "## Decisions", ""]
    lines += [f"- **{x['decision']}**: {decision_text(x)}" for x in rep.decisions]
    return lines


# -- the startup files --------------------------------------------------------------------------


def write_report(record: RunRecord, rep: RunReport) -> None:
    """A finished run's files: report.json, report.md, the startup files, report.html."""
    record.write_json("report.json", rep.model_dump(mode="json"))
    record.write("report.md", report_md(rep))
    # The files that start production: those `pretuner script RUN` writes.
    for name, text in run_scripts(rep, ScriptOptions(), [Target.ALL]).items():
        record.write(name, text, executable=name.endswith(".sh"))
    refresh_run_page(record.path)


def record_failure(record: RunRecord, method: Method, err: PretunerError, meta: RunMeta) -> None:
    """A failed run's report.json, report.md and report.html, attached to `err`, with every
    launch made: also one that raised before it had an outcome (the last launch_started)."""
    steps = [step_json(o) for o in method.outcomes]
    started = next(reversed(list(record.of_kind("launch_started"))), None)
    if started is not None and started["n"] > max((s.n for s in steps), default=0):
        n = int(started["n"])
        path = record.path / f"launch-{n}" / "server.log"
        log_path = err.log_path if isinstance(err, ServerFailedError) and err.log_path else (
            str(path) if path.is_file() else None)
        steps.append(unfinished_step(n, started["settings"], log_path))
    layout = method.layout()
    if meta.cluster:  # on a Ray cluster: the nodes the ranks were placed on
        layout["nodes"] = len(meta.cluster["nodes"])
    rep = failure_json(err, meta, steps, method.decisions, method.name, **layout)
    try:
        record.write_json("report.json", rep.model_dump(mode="json"))
        record.write("report.md", failure_md(rep))
    except (OSError, PretunerError) as write_err:
        # The run's own error is what the user must see; the journal still has every event.
        log.warning("could not write the failure report in %s: %s", record.path, write_err)
        return
    refresh_run_page(record.path)
    err.report = rep.model_dump(mode="json")  # `run --json` prints it beside the error
