"""A V1 run's record: report.json, report.md and the files that start production
(serve.sh, vllm-config.yaml for `vllm serve --config`, tuned.env), in the engine's own terms:
`--kv-cache-memory-bytes`, never r0.1's variables. report.json is the typed record
(`tune.records.V1Report`) dumped as JSON; the other files are rendered from the record."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from pretuner import __version__
from pretuner.engines.base import Deployment
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.errors import PretunerError, ServerFailedError
from pretuner.speed import Speed, too_slow
from pretuner.templating import render_template
from pretuner.tune.asked import given_up
from pretuner.tune.records import (
    Asked,
    Decision,
    Provenance,
    V1Baseline,
    V1Derivation,
    V1FailureReport,
    V1Final,
    V1Report,
    V1Speed,
    V1Step,
    V1Weights,
)
from pretuner.tune.report import step_json
from pretuner.tune.v1.loop import V1Result
from pretuner.tune.v1.report_knobs import report_md_sections
from pretuner.tune.v1.report_memory import (
    VisionMeta,
    final_launch,
    images_md,
    images_record,
    memory_md,
    memory_record,
    soak_record,
)
from pretuner.units import GIB

SIM_NOTE = ("EMULATED: the emulated vLLM server on an emulated CUDA card ran here; every "
            "figure is SIMULATED, not measured on a real device.")


@dataclass(frozen=True, slots=True)
class V1Meta:
    run_id: str
    engine: str
    engine_version: str | None
    engine_reason: str
    simulated: bool
    model: str
    model_arg: str  # what the server loads
    card_gib: int
    bytes_per_token: int
    serve_command: tuple[str, ...]  # the server command before the model
    deployment: Deployment
    device_kind: str = "cuda"  # "cpu": --card is a memory budget, not a device
    asked_max_model_len: int | None = None  # None: the final's (V1 never cuts it)
    asked_max_num_seqs: int | None = None
    retune_command: tuple[str, ...] = ()  # RunOptions.command_line()
    vision: VisionMeta | None = None  # a vision-language model's images and soak
    weights: V1Weights | None = None  # the weights knobs and their plan (predicted)
    min_tokens_per_s: float | None = None  # --min-tokens-per-s asked


def final_outcome(r: V1Result) -> LaunchOutcome | None:
    """The launch that proved the final configuration (None: not validated)."""
    return next((o for o in reversed(r.outcomes) if o.kind is OutcomeKind.OK
                 and o.settings == r.final), None) if r.validated else None


def speed_record(speed: Speed | None) -> V1Speed | None:
    return V1Speed(**speed.to_json()) if speed is not None else None


def report_json(r: V1Result, m: V1Meta) -> V1Report:
    """The record of a finished V1 run; report.json is its `model_dump(mode="json")`."""
    f = r.final
    proof = final_outcome(r)
    speed = proof.speed if proof is not None else None
    slow = too_slow(speed, m.min_tokens_per_s) if r.validated else None
    weights = m.weights
    if weights is not None and proof is not None:
        weights = weights.model_copy(update={"card_weights_log_gib": proof.weights_gib})
    gain = (r.kv_tokens / r.profiled_kv_tokens
            if r.kv_tokens and r.profiled_kv_tokens else None)
    budget = r.budget
    proof = final_launch(r.outcomes, f) if r.validated else None
    return V1Report(
        pretuner_version=__version__,
        run_id=m.run_id,
        engine=m.engine,
        engine_version=m.engine_version,
        engine_reason=m.engine_reason,
        simulated=m.simulated,
        model=m.model,
        model_arg=m.model_arg,
        card_gib=m.card_gib,
        device_kind=m.device_kind,
        tp=f.tp,
        pp=f.pp,
        validated=r.validated,
        launches=len(r.outcomes),
        measured_by=r.measured_by,
        provenance=_tag(m),
        final=V1Final(
            kv_cache_memory_bytes=f.kv_cache_bytes,
            kv_cache_gib=round((f.kv_cache_bytes or 0) / GIB, 3),
            kv_tokens=r.kv_tokens,
            max_model_len=f.max_model_len,
            max_num_seqs=f.max_num_seqs,
            max_num_batched_tokens=f.max_num_batched_tokens,
            flags=m.deployment.argv(),
            env=m.deployment.env,
            notes=list(m.deployment.notes),
            serve_command=[*m.serve_command, m.model_arg, *m.deployment.argv()],
            engine_serve_command=real_command(m) if m.simulated else None,
        ),
        baseline=V1Baseline(
            util=r.profiled_util,
            kv_tokens=r.profiled_kv_tokens,
            kv_tokens_gain=round(gain, 4) if gain else None,
        ),
        derivation=None if budget is None else V1Derivation(
            device_total_mib=budget.total_mib,
            device_peak_mib=budget.peak_mib,
            held_kv_mib=round(budget.held_kv_mib, 1),
            non_kv_peak_mib=round(budget.non_kv_mib, 1),
            margin_mib=budget.margin_mib,
            pinned_kv_mib=budget.kv_mib,
            lines=budget.lines(),
        ),
        decisions=list(r.decisions),
        steps=[step(o) for o in r.outcomes],
        asked=Asked(max_model_len=m.asked_max_model_len or f.max_model_len,
                    max_num_seqs=m.asked_max_num_seqs or f.max_num_seqs),
        given_up=given_up(m.asked_max_model_len or f.max_model_len,
                          m.asked_max_num_seqs or f.max_num_seqs,
                          f.max_model_len, f.max_num_seqs) + ([slow] if slow else []),
        retune_command=list(m.retune_command),
        images=images_record(m.vision, proof or _any_launch(r), f.max_model_len)
        if m.vision is not None else None,
        soak=soak_record(proof, m.vision.soak) if proof and m.vision else None,
        memory=memory_record(proof, m.bytes_per_token, _tag(m)) if proof else None,
        weights=weights,
        speed=speed_record(speed),
        min_tokens_per_s=m.min_tokens_per_s,
    )


def _tag(m: V1Meta) -> Provenance:
    return "simulated" if m.simulated else "measured"


def _any_launch(r: V1Result) -> LaunchOutcome | None:
    """A launch whose log said what the engine's encoder budget is (any will do)."""
    return next((o for o in r.outcomes if o.encoder_budget_tokens is not None), None)


def real_command(m: V1Meta) -> list[str]:
    """What the real engine would run with the same flags (a simulated run's serve.sh starts
    the emulated server)."""
    from pretuner.engines.vllm_v1 import ROWS
    from pretuner.models import resolve

    row = ROWS[m.engine]
    model = resolve(m.model).hf_id or m.model
    return [*row.command, model, *m.deployment.argv()]


def report_md(rep: V1Report) -> str:
    f = rep.final
    tag = rep.provenance
    status = "VALIDATED under the worst-case load" if rep.validated else "NOT VALIDATED"
    if rep.validated and rep.given_up:
        status += f", but less than asked: {'; '.join(rep.given_up)} (exit 9)"
    lines = [f"# pretuner run {rep.run_id}: {status}", ""]
    if rep.simulated:
        lines += [f"> {SIM_NOTE}", ""]
    lines += [
        f"- engine: {rep.engine} ({rep.engine_reason})",
        f"- model: {rep.model} (`{rep.model_arg}`), TP{rep.tp} x PP{rep.pp}, "
        + device_words(rep),
        f"- method: pre-run with the production shape, memory sampled ({rep.measured_by}), "
        "KV pinned with --kv-cache-memory-bytes",
        "",
        "## Result",
        "",
        f"- `--kv-cache-memory-bytes {f.kv_cache_memory_bytes}` "
        f"({f.kv_cache_gib:.2f} GiB, derived) = {f.kv_tokens or 0:,} KV tokens "
        f"({tag}, from the validation's log)",
    ]
    base = rep.baseline
    if base.kv_tokens:
        gain = f", {base.kv_tokens_gain:.3f}x" if base.kv_tokens_gain else ""
        lines.append(f"- the engine's own profiling at util {base.util}: "
                     f"{base.kv_tokens:,} KV tokens ({tag}){gain}")
    lines += [f"- max_model_len {f.max_model_len:,}, max-num-seqs {f.max_num_seqs}, "
              f"max-num-batched-tokens {f.max_num_batched_tokens:,}", ""]
    lines += images_md(rep)
    lines += report_md_sections(rep)
    d = rep.derivation
    if d is not None:
        lines += ["## Derivation", ""] + [f"- {line}" for line in d.lines] + [""]
    else:
        lines += ["## Derivation", "",
                  "- no device memory was sampled: the engine's own profiled KV is pinned "
                  "(nothing gained over its profiling, but proven)", ""]
    lines += memory_md(rep)
    lines += ["## Launches", "",
              "| # | purpose | KV asked | outcome | device peak MiB | KV tokens | s |",
              "|---|---|---|---|---|---|---|"]
    for s in rep.steps:
        kv = s.settings.kv_cache_bytes
        asked = f"{kv / GIB:.2f} GiB pinned" if kv else f"util {s.settings.util}"
        peak = max(s.device_peaks_mib.values(), default=None)
        shown_peak = f"{peak:,} ({tag})" if peak else "-"
        tokens = f"{s.kv_tokens:,}" if s.kv_tokens else "-"
        seconds = "-" if s.seconds is None else f"{s.seconds:.1f}"
        lines.append(f"| {s.n} | {s.purpose} | {asked} | {s.outcome} | {shown_peak} | "
                     f"{tokens} | {seconds} |")
    lines += ["", "## Decisions", ""]
    lines += [f"- {x['decision']}: {x['detail']}" for x in rep.decisions]
    lines += ["", "## Start production", "", "```sh", "./serve.sh", "```", ""]
    lines += [f"- {note}" for note in f.notes] + ([""] if f.notes else [])
    if f.engine_serve_command:
        lines += ["The figures above are simulated. With the real engine and a real device, the "
                  "same flags are (run `pretuner run` there to measure and prove them):", "",
                  "```sh", shlex.join(f.engine_serve_command), "```", ""]
    if rep.retune_command:
        lines += [f"Re-tune: `{shlex.join(rep.retune_command)}`", ""]
    return "\n".join(lines)


def device_words(rep: V1Report) -> str:
    """The devices as the run knew them: a real device's total as its reader measured it."""
    if rep.device_kind == "cpu":
        return (f"a {rep.card_gib} GiB memory budget (RLIMIT_DATA on every server process; "
                "vLLM on CPU has no device)")
    if not rep.simulated and rep.derivation is not None:
        return f"{rep.derivation.device_total_mib:,} MiB device(s) (measured)"
    return f"{rep.card_gib} GB device(s)"


def _header(rep: V1Report) -> list[str]:
    status = "validated under the worst-case load" if rep.validated else "NOT validated"
    head = [f"pretuner {rep.pretuner_version} run {rep.run_id}: {status}",
            f"{rep.engine}: {rep.model} on {device_words(rep)}, "
            f"KV pinned at {rep.final.kv_cache_gib:.2f} GiB"]
    if rep.simulated:
        head.append(SIM_NOTE)
    return head


def serve_sh(rep: V1Report) -> str:
    ctx = {"header": _header(rep), "secret_checks": [], "env": rep.final.env,
           "argv": rep.final.serve_command}
    return render_template("serve.sh.j2", ctx)


def vllm_config(rep: V1Report) -> str:
    """The tuned flags as `vllm serve --config` reads them (long names, no dashes)."""
    flags = rep.final.flags
    config: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        key = flags[i].removeprefix("--").replace("-", "_")
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        value: Any = flags[i + 1] if takes_value else True  # `--enforce-eager` alone: a switch
        config[key] = int(value) if isinstance(value, str) and value.isdigit() else value
        i += 2 if takes_value else 1
    return render_template("vllm-config.yaml.j2", {"header": _header(rep), "config": config})


def tuned_env(rep: V1Report) -> str:
    env = dict(rep.final.env)
    env["PRETUNER_KV_CACHE_MEMORY_BYTES"] = str(rep.final.kv_cache_memory_bytes)
    w = rep.weights  # the weights knobs the run proved, when given (serve.sh has the flags)
    if w is not None and w.quantization:
        env["PRETUNER_QUANTIZATION"] = w.quantization
    if w is not None and w.cpu_offload_gib:
        env["PRETUNER_CPU_OFFLOAD_GB"] = f"{w.cpu_offload_gib:g}"
    if w is not None and w.swap_space_gib is not None:
        env["PRETUNER_SWAP_SPACE_GB"] = f"{w.swap_space_gib:g}"
    if w is not None and w.enforce_eager:
        env["PRETUNER_ENFORCE_EAGER"] = "1"
    return render_template("tuned.env.j2", {"header": _header(rep), "env": env})


def failure_json(err: PretunerError, m: V1Meta, steps: list[V1Step],
                 decisions: list[Decision]) -> V1FailureReport:
    """The record of a V1 run stopped by `err`: why, the fix, every launch and decision."""
    return V1FailureReport(
        pretuner_version=__version__, run_id=m.run_id,
        engine=m.engine, engine_reason=m.engine_reason, simulated=m.simulated,
        model=m.model, model_arg=m.model_arg, card_gib=m.card_gib,
        validated=False, launches=len(steps), error=err.message, hint=err.hint,
        exit_code=int(err.exit_code), error_type=type(err).__name__,
        server_log=err.log_path if isinstance(err, ServerFailedError) else None,
        decisions=decisions, steps=steps,
    )


def failure_md(rep: V1FailureReport) -> str:
    reason, _, details = rep.error.partition("\n")
    lines = [f"# pretuner run {rep.run_id}: FAILED (exit {rep.exit_code})", ""]
    if rep.simulated:
        lines += [f"> {SIM_NOTE}", ""]
    lines += [f"- reason: {reason}", f"- fix: {rep.hint or 'read the server log'}",
              f"- engine: {rep.engine} ({rep.engine_reason})",
              f"- result: NOT validated after {rep.launches} launch(es); no serve.sh written",
              "", "## Launches", ""]
    lines += [f"- #{s.n} {s.purpose}: {s.outcome}"
              + (f" ({s.oom_text})" if s.oom_text else "") for s in rep.steps]
    lines += ["", "## Decisions", ""] + [f"- {d['decision']}: {d['detail']}"
                                         for d in rep.decisions]
    if details:
        lines += ["", "## Details", "", "```", details.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def step(o: LaunchOutcome) -> V1Step:
    """One launch as report.json's `steps[]` shows it for a V1 engine."""
    return V1Step(**dict(step_json(o)), kv_tokens=o.kv_tokens, kv_gib=o.kv_gib,
                  device_total_mib=o.device_total_mib, oom_alloc_bytes=o.oom_alloc_bytes,
                  device_last_mib=o.device_last_mib, soak_requests=o.soak_requests,
                  reset_status=o.reset_status, speed=speed_record(o.speed),
                  weights_gib=o.weights_gib)


def systemd_unit(rep: V1Report, install_dir: str = "/etc/pretuner") -> str:
    """A systemd unit that starts the run's server command with tuned.env."""
    return render_template("systemd.service.j2", {
        "header": _header(rep),
        "env_path": f"{install_dir}/tuned.env",
        "unit_description": f"{rep.engine} serving {rep.model} (tuned by pretuner)",
        "argv": rep.final.serve_command,
    })
