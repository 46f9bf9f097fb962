"""`pretuner run`: the automated pre-run, fallbacks, validation under load, and the run record."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from pretuner.cli.app import app
from pretuner.cli.render import echo_json, table
from pretuner.cli.run_v1 import render_v1_dry_run, render_v1_summary
from pretuner.errors import BadInputError, PretunerError, RunInterrupted
from pretuner.launch.groups import report_stops_to
from pretuner.launch.process import install_signal_handlers
from pretuner.presets.compare import preset_line
from pretuner.tune.entry import (
    DryRun,
    RunOptions,
    RunOutcome,
    dry_run,
    engine_for,
    run_tuning,
)
from pretuner.tune.v1.entry import V1RunOutcome
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


class Progress:
    """One line per phase on stderr, with the time since the run started."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.launch = 0

    def __call__(self, phase: str, detail: str) -> None:
        if phase == "launch":
            self.launch += 1
        if self.quiet:
            return
        elapsed = time.monotonic() - self.t0
        tag = f"#{self.launch}" if self.launch else "  "
        typer.echo(f"[{elapsed:7.1f}s] {tag:>3} {phase:<7} {detail}", err=True)


@app.command("run")
def run_cmd(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "--model", "-m", help="Registry name, alias, or model path the server loads."
    ),
    card: int | None = typer.Option(
        None,
        "--card",
        help="Card GiB (default: what the device tool reports; the emulated card: 64, 80 for "
        "V1 engines). vllm-cpu: the memory budget every server process runs under (default 6).",
    ),
    backend: str = typer.Option(
        "auto",
        "--backend",
        help="auto | vllm-mindspore | sim | mindspore-cpu (real MindSpore on CPU; never auto).",
    ),
    engine: str = typer.Option(
        "auto",
        "--engine",
        help="auto | vllm-mindspore-r01 | vllm | vllm-ascend | vllm-mindspore (0.3+) | vllm-cpu. "
        "A V1 engine (all but r01) gets its KV cache pinned with --kv-cache-memory-bytes; "
        "without its stack or devices the emulated vLLM server runs (simulated figures).",
    ),
    max_num_seqs: int | None = typer.Option(
        None,
        "--max-num-seqs",
        help="V1 engines: production's max-num-seqs (default vLLM's 256; vllm-cpu 8).",
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None,
        "--max-num-batched-tokens",
        help="V1 engines: production's prefill step budget (default: the engine's, 8192 on "
        "vLLM).",
    ),
    server_arg: list[str] = typer.Option(
        [],
        "--server-arg",
        help="V1 engines: more server flags, launched and kept in serve.sh (repeat; each "
        "value is shell-split), e.g. --server-arg '--load-format dummy'.",
    ),
    max_model_len: int | None = typer.Option(
        None,
        "--max-model-len",
        help="Longest request to support (default 16384; 1024 on mindspore-cpu).",
    ),
    min_model_len: int | None = typer.Option(
        None,
        "--min-model-len",
        help="Shortest length the fallback may go to (default 4096; 256 on mindspore-cpu).",
    ),
    util: float = typer.Option(
        0.9, "--util", help="Pre-run --gpu-memory-utilization (the method's 0.9)."
    ),
    tp: int | None = typer.Option(
        None, "--tp", help="Tensor parallel size (default: chosen by plan)."
    ),
    pp: int = typer.Option(1, "--pp", help="Pipeline parallel size."),
    nodes: int | None = typer.Option(None, "--nodes", help="Nodes (default: from the layout)."),
    block_size: int = typer.Option(16, "--block-size", help="KV block size in tokens (r0.1: 16)."),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype", help="auto|bf16|fp16|int8|fp8|int8-mla."
    ),
    weights_format: str | None = typer.Option(
        None, "--weights-format", help="Checkpoint format (bf16, w8a8...)."
    ),
    headroom_gb: float | None = typer.Option(
        None,
        "--headroom-gb",
        help="Base GiB added to measured weights+activations (default: 64 MiB + 2% of the "
        "measured activations + the spread between ranks; per-sequence headroom on top).",
    ),
    reserve_gb: float | None = typer.Option(
        None, "--reserve-gb", help="GiB kept free below the card's free memory."
    ),
    model_use_gb: int | None = typer.Option(
        None,
        "--model-use-gb",
        help="Pin the pre-run's vLLM_MODEL_MEMORY_USE_GB (default: the most the length allows).",
    ),
    max_launches: int = typer.Option(8, "--max-launches", help="Most server launches to spend."),
    validate: bool = typer.Option(
        True, "--validate/--no-validate", help="Prove the result under full load."
    ),
    serve_cmd: str | None = typer.Option(
        None, "--serve-cmd", help="Server command to use instead of the backend's."
    ),
    out: str | None = typer.Option(  # a str: typer reads '' as Path('.'), the current folder
        None, "--out", help="Run folder (default: a new one under runs/)."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue an interrupted run folder."
    ),
    seed: int = typer.Option(0, "--seed", help="Probe prompt seed (and the emulated card's seed)."),
    ready_timeout: float = typer.Option(
        1800.0, "--ready-timeout", help="Seconds to wait for /health."
    ),
    stop_grace: float = typer.Option(
        120.0, "--stop-grace", help="Seconds between SIGTERM and SIGKILL."
    ),
    request_timeout: float = typer.Option(
        900.0, "--request-timeout", help="Seconds one probe or load request may take."
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="Multi-node: the Ray cluster (HOST:PORT or auto) to place the ranks on and "
        "gather every node's logs from (needs the `ray` extra).",
    ),
    dry: bool = typer.Option(False, "--dry-run", help="Print the first launch and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print report.json to stdout."),
) -> None:
    """Pre-run, derive, fall back, validate under load, and write tuned.env / serve.sh.

    With --resume RUN the run goes on with the options it recorded: no other flag but --json
    may be given (a changed option would make the journal describe another run).
    """
    if resume is not None:
        refuse_flags_with_resume(ctx, dry)
    elif model is None:
        raise typer.BadParameter("--model is required (or --resume RUN)", param_hint="--model")
    opts = RunOptions(
        model=model or "",
        backend=backend,
        engine=engine,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        server_args=list(server_arg),
        card_gib=card,
        util=util,
        max_model_len=max_model_len,
        min_model_len=min_model_len,
        tp=tp,
        pp=pp,
        nodes=nodes,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        weights_format=weights_format,
        headroom_gib=headroom_gb,
        reserve_gib=reserve_gb,
        max_launches=max_launches,
        validate=validate,
        model_use_gib=model_use_gb,
        serve_cmd=serve_cmd,
        out=out,
        seed=seed,
        ready_timeout_s=ready_timeout,
        stop_grace_s=stop_grace,
        request_timeout_s=request_timeout,
        ray_address=ray_address,
    )
    if dry and engine_for(opts) is not None:
        typer.echo(render_v1_dry_run(opts))
        return
    if dry:
        typer.echo(render_dry_run(dry_run(opts)))
        if ray_address:
            typer.echo(RAY_DRY_RUN.format(address=ray_address))
        return
    restore = install_signal_handlers()
    progress = Progress(quiet=as_json)
    unreport = report_stops_to(lambda message: progress("stop", message))
    try:
        outcome = run_tuning(opts, progress, resume=resume)
    except KeyboardInterrupt:  # before the run had a folder; after, it is a RunInterrupted
        raise RunInterrupted(None) from None
    except PretunerError as err:
        if as_json:
            echo_json(error_json(err))
        raise  # the error boundary prints the one-line error and exits with its code
    finally:
        unreport()
        restore()
    if as_json:
        echo_json(outcome.report)
    elif isinstance(outcome, V1RunOutcome):
        typer.echo(render_v1_summary(outcome))
    else:
        typer.echo(render_summary(outcome))
    if not outcome.result.validated and opts.validate:
        raise typer.Exit(6)


# Flags that do not change the run, so a --resume may carry them.
RESUME_FLAGS = frozenset({"resume", "as_json", "ctx"})


def refuse_flags_with_resume(ctx: typer.Context, dry: bool) -> None:
    """--resume goes on with the recorded options: a flag that would change them is refused."""
    if dry:
        raise BadInputError(
            "--dry-run cannot be combined with --resume: a resumed run continues what it "
            "recorded, it has no first launch to print",
            hint="drop --dry-run to continue the run; its journal.jsonl lists its launches",
        )
    flags = {p.name: p.opts[0] for p in ctx.command.params if p.name}
    given = [
        flags.get(name, name)
        for name in ctx.params
        if name not in RESUME_FLAGS
        and _given(ctx, name)
    ]
    if given:
        raise BadInputError(
            f"{', '.join(given)} cannot be given with --resume: the run goes on with the "
            "options it recorded",
            hint="drop " + " ".join(given) + " to resume, or start a new run with the new values",
        )


def _given(ctx: typer.Context, name: str) -> bool:
    # By name: typer may bring its own copy of click, and with it its own ParameterSource.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def error_json(err: PretunerError) -> dict[str, Any]:
    """What `run --json` prints on a failure: the error, and the failure report when the run
    got as far as its run folder."""
    head = {
        "error": err.message,
        "hint": err.hint,
        "exit_code": int(err.exit_code),
        "error_type": type(err).__name__,
        "run_record": str(err.run_record) if err.run_record is not None else None,
    }
    return {**head, **{k: v for k, v in (err.report or {}).items() if k not in head}}


def render_dry_run(d: DryRun) -> str:
    lines = []
    if d.backend.simulated:
        lines.append(SIM_BANNER)
    lines += [
        f"backend: {d.backend.backend.value} ({d.backend.reason})",
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
    if rep["simulated"]:
        lines.append(SIM_BANNER)
    status = "VALIDATED under full load" if rep["validated"] else "NOT VALIDATED"
    tag = "simulated" if rep["simulated"] else "measured"
    rows = [
        (s["n"], s["purpose"], s["settings"]["util"], s["settings"]["model_use_gib"],
         f"{s['settings']['max_model_len']:,}", s["settings"]["max_num_seqs"], s["outcome"],
         f"{s['worst_peak_mib']:,}" if s["worst_peak_mib"] else "-", f"{s['seconds']:.1f}")
        for s in rep["steps"]
    ]  # fmt: skip
    lines += [
        f"{rep['model']} on {rep['card_gib']} GiB cards, TP{rep['tp']} x PP{rep['pp']}, "
        f"{rep['nodes']} node(s): {status} after {rep['launches']} launch(es)",
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
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in rep["final"]["flags"].items())
    lines += [flags, preset_line(rep["model"], rep["card_gib"], rep["tp"], f.kv_tokens, tag)]
    if "cluster" in rep:
        lines.append(cluster_line(rep))
    lines += ["", f"run record: {o.record}  (report.md, tuned.env, serve.sh)"]
    return "\n".join(lines)


def cluster_line(rep: dict[str, Any]) -> str:
    """Where the ranks ran and where each launch's worst rank was."""
    c = rep["cluster"]
    where = ", ".join(
        f"{n['node']}{' (this node)' if n['local'] else ''}: {n['ranks']} ranks"
        for n in c["nodes"]
    )
    worst = "; ".join(
        f"#{s['n']} {s['worst_node']}" for s in rep["steps"] if s.get("worst_node")
    )
    return f"Ray cluster at {c['gcs_address']}: {where}; worst rank on: {worst or '-'}"
