"""`pretuner run`: the automated pre-run, fallbacks, validation under load, and the run record."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

import pretuner.cli.options as o
from pretuner.cli.app import app
from pretuner.cli.render import emit
from pretuner.cli.vocab import (
    CONFIG_EXTRA,
    KvDtype,
    config_callback,
    human_int,
    human_minutes,
)
from pretuner.errors import BadInputError, ExitCode, RunInterrupted

# The tuner is imported inside `run_cmd`: `pretuner --help` and a usage error answer without
# loading it (tests/test_cli_startup.py).


@app.command(
    "run", cls=o.PanelCommand,
    short_help="Pre-run, derive, validate under full load, write the start files.",
    epilog="""\b
Examples:
  pretuner run --model qwen3-8b --card 64                  r0.1 (emulated card if no NPU)
  pretuner run -m qwen3-8b --engine vllm --max-model-len 32K --max-num-seqs 64
  pretuner run -m qwen3-8b --engine vllm --engine-python ~/vllm-env/bin/python
  pretuner run -m qwen3-8b --engine vllm --card 80 --emulate   the emulated vLLM server
  pretuner run --config serve.yaml --engine vllm           your `vllm serve --config` file
  pretuner run -m ./my-model --engine vllm-cpu --card 6   real vLLM on CPU, 6 GiB budget
  pretuner run --resume runs/<run>                         go on after Ctrl-C

\b
Exit codes: 0 validated as asked, 9 validated but shorter, fewer sequences or slower
(--min-tokens-per-s) than asked,
6 nothing validated, 2 bad input, 4 infeasible, 5 server failed, 8 card busy, 130 interrupted.""",
)
def run_cmd(
    ctx: typer.Context,
    model: o.Model = None,
    card_gib: o.Card = None,
    backend: str | None = typer.Option(
        None, "--backend", metavar="NAME", hidden=True,
        help="The old name of --engine (sim, mindspore-cpu, vllm-mindspore), one release more.",
    ),
    engine: o.Engine = "auto",
    emulate: o.Emulate = False,
    engine_python: str | None = typer.Option(
        None, "--engine-python", metavar="PATH", rich_help_panel=o.ENGINE,
        help="V1 engines: the Python of the venv or conda env that has the engine (default "
        "$PRETUNER_ENGINE_PYTHON); checked there, and the engine started with it.",
    ),
    max_num_seqs: int | None = typer.Option(
        None, "--max-num-seqs", metavar="N", rich_help_panel=o.LENGTHS,
        help="V1 engines: production's max-num-seqs (default: the engine's, asked of it or by "
        "vLLM's rule: 1024 on H100/H200-class GPUs, else 256; vllm-cpu 8).",
    ),
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    server_args: list[str] = typer.Option(
        [], "--server-arg", metavar="FLAGS", rich_help_panel=o.ENGINE,
        help="V1 engines: more server flags, launched and kept in serve.sh (repeat; each "
        "value is shell-split), e.g. --server-arg '--load-format dummy'.",
    ),
    limit_mm_per_prompt: o.LimitMmPerPrompt = None,
    mm_processor_cache_gb: o.MmProcessorCacheGb = None,
    soak: int | None = typer.Option(
        None, "--soak", metavar="N", rich_help_panel=o.PROOF,
        help="VL models: N mixed image requests after the worst case (default 200; 0: none); "
        "the memory they leave is held back from the KV cache.",
    ),
    soak_minutes: float | None = typer.Option(
        None, "--soak-minutes", metavar="DURATION", parser=human_minutes,
        rich_help_panel=o.PROOF,
        help="VL models: soak this long: 90 (minutes), 90m, 1.5h or 2h30m (with --soak: "
        "whichever ends first).",
    ),
    quantization: o.Quantization = None,
    cpu_offload_gib: o.CpuOffloadGb = 0.0,
    swap_space_gib: o.SwapSpace = None,
    enforce_eager: bool = typer.Option(
        False, "--enforce-eager/--no-enforce-eager", rich_help_panel=o.ENGINE,
        help="V1 engines: no CUDA graphs (no graph pool on the card; slower decode).",
    ),
    min_tokens_per_s: float | None = typer.Option(
        None, "--min-tokens-per-s", metavar="RATE", rich_help_panel=o.PROOF,
        help="V1 engines: the validation's decode speed (one sequence alone) must reach this "
        "many tokens/s, else exit 9 with the files written.",
    ),
    max_model_len: o.MaxModelLen = None,
    min_model_len: int | None = typer.Option(
        None, "--min-model-len", metavar="TOKENS", parser=human_int, rich_help_panel=o.LENGTHS,
        help="Shortest length the fallback may go to (default 4096; 256 on mindspore-cpu).",
    ),
    util: o.Util = 0.9,
    tp: o.Tp = None,
    pp: o.Pp = None,
    nodes: o.Nodes = None,
    cards_per_node: o.CardsPerNode = 8,
    block_size: o.BlockSize = None,
    kv_cache_dtype: o.KvCacheDtype = KvDtype.AUTO,
    weights_format: o.WeightsFormat = None,
    headroom_gib: float | None = typer.Option(
        None, "--headroom-gb", metavar="GIB", rich_help_panel=o.ADVANCED,
        help="Base GiB added to measured weights+activations (default: 64 MiB + 2% of the "
        "measured activations + the spread between ranks; per-sequence headroom on top).",
    ),
    reserve_gib: float | None = typer.Option(
        None, "--reserve-gb", metavar="GIB", rich_help_panel=o.ADVANCED,
        help="GiB kept free below the card's free memory (default: what npu-smi saw outside "
        "MindSpore's pool + 1/8192 of the card; 0.25 GiB per 64 GB without a device reading).",
    ),
    model_use_gib: int | None = typer.Option(
        None, "--model-use-gb", metavar="GIB", rich_help_panel=o.ADVANCED,
        help="Pin the pre-run's vLLM_MODEL_MEMORY_USE_GB (default: the most the length allows).",
    ),
    max_launches: int = typer.Option(
        8, "--max-launches", metavar="N", rich_help_panel=o.PROOF,
        help="Most server launches to spend.",
    ),
    validate: bool = typer.Option(
        True, "--validate/--no-validate", rich_help_panel=o.PROOF,
        help="Prove the result under full load.",
    ),
    repeat_proof: int = typer.Option(
        1, "--repeat-proof", metavar="N", rich_help_panel=o.PROOF,
        help="Prove the final configuration on N boots (N-1 more launches) and keep at least "
        "their peaks' spread as headroom (default 1: a documented floor, `pretuner explain`).",
    ),
    serve_cmd: str | None = typer.Option(
        None, "--serve-cmd", metavar="COMMAND", rich_help_panel=o.ENGINE,
        help="Your command that starts the engine (another venv, a container, a wrapper), launched "
        "and written to serve.sh in place of the engine's own; pretuner's flags follow it. "
        "{port} in it is the port of each launch (docker run -p 127.0.0.1:{port}:{port} ...).",
    ),
    out: str | None = typer.Option(  # a str: typer reads '' as Path('.'), the current folder
        None, "--out", metavar="DIR", rich_help_panel=o.OUTPUTS,
        help="Run folder (default: a new one under runs/).",
    ),
    resume: Path | None = typer.Option(
        None, "--resume", metavar="RUN", rich_help_panel=o.OUTPUTS,
        help="Continue an interrupted run folder.",
    ),
    seed: int = typer.Option(
        0, "--seed", metavar="N", rich_help_panel=o.ADVANCED,
        help="Probe prompt seed (and the emulated card's seed).",
    ),
    ready_timeout_s: float = typer.Option(
        1800.0, "--ready-timeout", metavar="SECONDS", rich_help_panel=o.ADVANCED,
        help="Seconds to wait for /health.",
    ),
    stop_grace_s: float = typer.Option(
        120.0, "--stop-grace", metavar="SECONDS", rich_help_panel=o.ADVANCED,
        help="Seconds between SIGTERM and SIGKILL.",
    ),
    request_timeout_s: float = typer.Option(
        900.0, "--request-timeout", metavar="SECONDS", rich_help_panel=o.PROOF,
        help="Seconds one probe or load request may take.",
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", metavar="HOST:PORT", rich_help_panel=o.ENGINE,
        help="Multi-node: the Ray cluster (HOST:PORT or auto) to place the ranks on and "
        "gather every node's logs from (needs the `ray` extra).",
    ),
    config: Path | None = typer.Option(
        None, "--config", metavar="FILE", is_eager=True, callback=config_callback,
        rich_help_panel=o.ENGINE,
        help="A `vllm serve --config` YAML: its max-model-len, gpu-memory-utilization, "
        "tensor-parallel-size... become this run's values (a flag given here wins); other keys "
        "go to a V1 engine's server (host, port, served-model-name: to serve.sh only; "
        "api-key: read there from the environment).",
    ),
    dry: bool = typer.Option(False, "--dry-run", rich_help_panel=o.OUTPUTS,
                             help="Print the first launch and exit."),
    as_json: bool = typer.Option(False, "--json", rich_help_panel=o.OUTPUTS,
                                 help="Print report.json to stdout."),
) -> None:
    """Pre-run, derive, fall back, validate under load, and write tuned.env / serve.sh.

    With --resume RUN the run goes on with the options it recorded: no other flag but --json
    may be given (a changed option would make the journal describe another run).
    """
    from pretuner.cli.progress import Progress
    from pretuner.cli.run_render import dry_run_json, render_dry_run, render_summary
    from pretuner.engines.registry import engine_of_backend
    from pretuner.launch.process import install_signal_handlers
    from pretuner.procgroups import report_stops_to
    from pretuner.tune.entry import dry_run, run_tuning

    if resume is not None:
        refuse_flags_with_resume(ctx, dry)
    elif model is None:
        raise typer.BadParameter("--model is required (or --resume RUN)", param_hint="--model")
    if backend is not None:
        engine = engine_of_backend(backend, engine)
        typer.echo(f"pretuner: --backend is the old name of --engine and goes in the next "
                   f"release: use --engine {engine}", err=True)
    opts = o.run_options(ctx.params, model=model or "", engine=engine,
                         server_args=[*ctx.meta.get(CONFIG_EXTRA, []), *server_args])
    if dry:
        d = dry_run(opts)
        emit(as_json, dry_run_json(d, ray_address), render_dry_run(d, ray_address))
        return
    restore = install_signal_handlers()
    # Progress goes to stderr under --json too: stdout carries the JSON alone.
    progress = Progress(sys.stderr, max_launches)
    unreport = report_stops_to(lambda message: progress("stop", message))
    try:
        outcome = run_tuning(opts, progress, resume=resume)
    except KeyboardInterrupt:  # before the run had a folder; after, it is a RunInterrupted
        raise RunInterrupted(None) from None
    # A PretunerError goes to the error boundary (pretuner.cli.app.main): one line on stderr,
    # its exit code, and under --json the error object on stdout.
    finally:
        progress.close()
        unreport()
        restore()
    emit(as_json, outcome.report.model_dump(mode="json"),  # report.json, as written
         render_summary(outcome.report, outcome.record))
    code = ExitCode.of_finished_run(outcome.result.validated, opts.validate,
                                    bool(outcome.report.given_up))
    if code:
        raise typer.Exit(int(code))


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
    # By name: typer may bring its own copy of click, and with it its own ParameterSource.
    sources = {name: getattr(ctx.get_parameter_source(name), "name", None) for name in ctx.params}
    given = [flags.get(name, name) for name, source in sources.items()
             if name not in RESUME_FLAGS and source not in (None, "DEFAULT", "DEFAULT_MAP")]
    if given:
        raise BadInputError(
            f"{', '.join(given)} cannot be given with --resume: the run goes on with the "
            "options it recorded",
            hint="drop " + " ".join(given) + " to resume, or start a new run with the new values",
        )

