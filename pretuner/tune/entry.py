"""`run_tuning(opts)`: the entrypoint behind `pretuner run` (typed config in, result out)."""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pretuner import __version__
from pretuner.devices import select_reader
from pretuner.engines.base import Family
from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.registry import EngineChoice, choose_engine
from pretuner.errors import BadInputError, PretunerError, RunInterrupted
from pretuner.method import check_launch_settings
from pretuner.models import builtin_specs, resolve
from pretuner.tune.backends import (
    BackendChoice,
    choose_backend,
    detect_card,
    engine_version,
    lengths_for,
)
from pretuner.tune.config import pool_on_demand
from pretuner.tune.execute import LaunchContext, Phase
from pretuner.tune.failure import record_failure
from pretuner.tune.loop import (
    CardInfo,
    TuneConfig,
    Tuner,
    TuneResult,
    plan_for,
    prerun_util,
    recorded_executor,
)
from pretuner.tune.options import RunOptions as RunOptions
from pretuner.tune.options import v1_only_flags
from pretuner.tune.ownership import (
    check_no_orphans,
    claim_new_folder,
    disk_full_error,
    is_disk_full,
    lock_folder,
    stop_own_orphans,
)
from pretuner.tune.record import RunRecord, check_folder_name
from pretuner.tune.records import RunReport
from pretuner.tune.report import RunMeta, report_json, write_report
from pretuner.tune.server_cmd import check_server_installed, server_model_arg, sim_env
from pretuner.tune.settings import (
    Backend,
    LaunchCommand,
    LaunchSettings,
    _version_tuple,
    build_launch,
    default_serve_command,
)
from pretuner.tune.v1.entry import V1RunOutcome, tune_v1_recorded, v1_setup

if TYPE_CHECKING:
    from pretuner.cluster.collector import RayCollectors

log = logging.getLogger(__name__)

# What each backend's server runs on, for its device memory reader.
DEVICE_KINDS = {
    Backend.SIM: "emulated",
    Backend.VLLM_MINDSPORE: "ascend",
    Backend.MINDSPORE_CPU: "cpu",
}
NO_READER = "no device memory reader here: measuring from the logs only"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    record: Path
    report: RunReport  # report.json is report.model_dump(mode="json")
    result: TuneResult
    backend: BackendChoice


@dataclass(frozen=True, slots=True)
class DryRun:
    backend: BackendChoice
    card: CardInfo
    prerun: LaunchSettings
    command: LaunchCommand
    layout_reason: str


def _check_lengths(max_len: int, min_len: int) -> None:
    if max_len < 1:
        raise BadInputError(
            f"--max-model-len {max_len} is invalid", hint="e.g. --max-model-len 16384"
        )
    if min_len < 1 or min_len > max_len:
        raise BadInputError(
            f"--min-model-len {min_len} must be between 1 and --max-model-len {max_len}",
            hint=f"e.g. --min-model-len {max(1, max_len // 4)}",
        )


def _setup(
    opts: RunOptions, card: CardInfo | None = None
) -> tuple[TuneConfig, BackendChoice, LaunchContext, list[str], dict[str, str]]:
    opts.check()
    if opts.server_args:
        raise BadInputError("--server-arg (and a --config key pretuner does not read) passes "
                            "flags to a V1 engine's server; the r0.1 "
                            "method builds its own command",
                            hint="name a V1 engine (--engine vllm|vllm-cpu|...), or give the "
                            "whole command with --serve-cmd")
    image_flags = [flag for flag, value in (
        ("--limit-mm-per-prompt", opts.limit_mm_per_prompt),
        ("--mm-processor-cache-gb", opts.mm_processor_cache_gb), ("--soak", opts.soak),
        ("--soak-minutes", opts.soak_minutes)) if value is not None]
    if image_flags:
        raise BadInputError(f"{', '.join(image_flags)}: the r0.1 method sends no images "
                            "(vLLM-MindSpore r0.1, on vLLM 0.6.6, serves no Qwen3-VL)",
                            hint="name a V1 engine (--engine vllm|vllm-ascend|vllm-mindspore) "
                            f"for a vision-language model, or drop {' '.join(image_flags)}")
    if v1_only := v1_only_flags(opts):
        raise BadInputError(f"{v1_only[0]} (given, or a --config key) is a V1 engine's "
                            "flag; the r0.1 method builds its own command",
                            hint="name a V1 engine (--engine vllm|...)")
    spec = resolve(opts.model)
    if opts.backend == Backend.MINDSPORE_CPU.value and not spec.eager_attention:
        names = " or --model ".join(s.name for s in builtin_specs() if s.eager_attention)
        raise BadInputError(
            f"--backend mindspore-cpu serves the CPU reference models, not {spec.name}",
            hint=f"use --model {names}, or --backend sim",
        )
    if opts.backend == Backend.MINDSPORE_CPU.value and (opts.tp or 1) * opts.pp != 1:
        raise BadInputError(
            f"--backend mindspore-cpu runs one card; TP{opts.tp or 1} x PP{opts.pp} needs several",
            hint="drop --tp/--pp (the reference server is a single process)",
        )
    choice = choose_backend(opts.backend)
    lengths = lengths_for(choice.backend)
    max_len = lengths.max_model_len if opts.max_model_len is None else opts.max_model_len
    min_len = (
        min(lengths.min_model_len, max_len) if opts.min_model_len is None else opts.min_model_len
    )
    _check_lengths(max_len, min_len)
    base_env = sim_env(opts, choice, spec.weights_format(opts.weights_format).name, 1)
    if card is None:
        card = detect_card(choice, opts.card_gib, {**os.environ, **base_env})
    cfg = TuneConfig(
        model=spec,
        card=card,
        util=opts.util,
        max_model_len=max_len,
        min_model_len=min_len,
        tp=1 if choice.backend is Backend.MINDSPORE_CPU else opts.tp,
        pp=opts.pp,
        nodes=opts.nodes,
        block_size=opts.block_size,
        kv_cache_dtype=opts.kv_cache_dtype,
        weights_format=opts.weights_format,
        headroom_gib=opts.headroom_gib,
        reserve_gib=opts.reserve_gib,
        max_launches=opts.max_launches,
        validate=opts.validate,
        model_use_gib=opts.model_use_gib,
        len_ladder=lengths.ladder,
        provenance="simulated" if choice.simulated else "measured",
    )
    if opts.model_use_gib is not None:
        check_launch_settings(card.card_gib, prerun_util(cfg), opts.model_use_gib)
    p = plan_for(cfg)
    extra_env = sim_env(opts, choice, p.weights_format, p.nodes)
    cfg = replace(cfg, pool_on_demand=pool_on_demand({**os.environ, **extra_env}))
    if opts.serve_cmd:
        base_cmd, model_as_flag = shlex.split(opts.serve_cmd), True
        if not base_cmd:
            raise BadInputError("--serve-cmd is empty", hint="e.g. --serve-cmd 'my-wrapper serve'")
    else:
        base_cmd, model_as_flag = default_serve_command(choice.backend, choice.engine_version)
        check_server_installed(base_cmd)
    served = spec.name
    model_arg = server_model_arg(opts.model, spec, choice.backend)

    def build(settings: LaunchSettings, port: int) -> LaunchCommand:
        return build_launch(
            settings,
            base_command=base_cmd,
            model_as_flag=model_as_flag,
            model=model_arg,
            served_name=served,
            host=opts.host,
            port=port,
            nodes=p.nodes,
            extra_env=extra_env,
        )

    ctx = LaunchContext(
        build=build,
        served_name=served,
        host=opts.host,
        ready_timeout_s=opts.ready_timeout_s,
        request_timeout_s=opts.request_timeout_s,
        stop_grace_s=opts.stop_grace_s,
        seed=opts.seed,
        decode_tokens=lengths.decode_tokens,
        device_reader=select_reader(
            DEVICE_KINDS[choice.backend], {**os.environ, **extra_env}, p.tp * p.pp
        ),
    )
    model_args = ["--model", model_arg] if model_as_flag else [model_arg]
    return cfg, choice, ctx, base_cmd + model_args, extra_env


def tune_in_process(
    opts: RunOptions, workdir: Path, card: CardInfo | None = None, phase: Phase | None = None
) -> TuneResult:
    """The whole loop against the emulated server run in this process (benchmarks, tests)."""
    from pretuner.sim.executor import inprocess_executor

    cfg, _, ctx, _, _ = _setup(opts, card)
    execute = inprocess_executor(ctx.build, workdir, ctx.decode_tokens)  # samples no card
    return Tuner(cfg, execute, phase or (lambda p, d: None)).run()


def dry_run(opts: RunOptions) -> DryRun:
    """What the first launch would be, without launching anything or writing a record."""
    cfg, choice, ctx, _, _ = _setup(opts)
    tuner = Tuner(cfg, _no_launch, lambda phase, detail: None)
    settings = tuner.prerun_settings(prerun_util(cfg), cfg.max_model_len)
    return DryRun(choice, cfg.card, settings, ctx.build(settings, 0), tuner.plan.layout_reason)


def _no_launch(settings: LaunchSettings) -> LaunchOutcome:
    raise AssertionError("a dry run launches nothing")


def _open_record(opts: RunOptions, resume: Path | None) -> tuple[RunRecord, RunOptions]:
    if resume is not None:
        record = RunRecord.open(resume)
        record.lock = lock_folder(record.path)  # a second --resume of this run is refused
        started = next(record.of_kind("run_started"), None)
        if started is None:
            raise BadInputError(f"{str(resume)!r} has no run_started entry", hint="start a new run")
        if next(record.of_kind("run_finished"), None) is not None:
            raise BadInputError(
                f"run {str(resume)!r} already finished", hint="start a new run instead"
            )
        return record, RunOptions.from_json(started.get("options"), started.get("version"))
    if opts.out is not None:
        check_folder_name(opts.out, "--out")
        out = Path(opts.out)
        check_no_orphans(out.parent, own=out)  # a server a killed run left on the card
        record = RunRecord(path=out, lock=claim_new_folder(out))  # new or empty, and locked
    else:
        check_no_orphans(Path(opts.runs_dir))
        record = RunRecord.create(Path(opts.runs_dir), opts.model, opts.card_gib)
    record.append("run_started", options=opts.to_json(), version=__version__)
    return record, opts


def engine_for(opts: RunOptions) -> EngineChoice | None:
    """The V1 engine `opts` asks for, or None for the r0.1 method (`--backend`)."""
    if opts.engine == "auto":
        if opts.backend == Backend.VLLM_MINDSPORE.value:
            version = engine_version()  # 0.3 and later are V1: the r0.1 variables are ignored
            if version is not None and _version_tuple(version) >= (0, 3):
                return choose_engine("vllm-mindspore")
        if opts.backend != "auto":
            return None  # --backend names an r0.1 backend
    choice = choose_engine(opts.engine)
    if choice.family is Family.V1 and opts.backend != "auto":
        raise BadInputError(f"--engine {opts.engine} and --backend {opts.backend} both name the "
                            "server", hint="keep --engine (--backend is the r0.1 method's)")
    return choice if choice.family is Family.V1 else None


def run_tuning(
    opts: RunOptions, phase: Phase, resume: Path | None = None
) -> RunOutcome | V1RunOutcome:
    """Tune, journal every launch and decision, and write the result files."""
    asked = opts if resume is None else _recorded_options(resume)
    v1 = engine_for(asked) if asked is not None else None
    if v1 is not None:
        if resume is None:
            v1_setup(opts, v1)  # refuse bad input before a run folder exists
        return _tune(opts, phase, resume, None)
    if resume is None:
        _setup(opts)  # refuse bad input before a run folder exists
    if asked is None or not asked.ray_address:
        return _tune(opts, phase, resume, None)
    # Multi-node: the cluster is checked before a run folder exists, and stays connected.
    from pretuner.cluster.session import ClusterPlan, ray_cluster

    cfg, choice, *_ = _setup(asked)
    p = plan_for(cfg)
    plan = ClusterPlan(p.tp * p.pp, p.nodes, emulated=choice.backend is Backend.SIM)
    with ray_cluster(asked.ray_address, plan, phase) as collectors:
        return _tune(opts, phase, resume, collectors)


def _recorded_options(resume: Path) -> RunOptions | None:
    try:
        started = next(RunRecord.open(resume).of_kind("run_started"), None)
    except PretunerError:
        return None  # _open_record says what is wrong with it
    if started is None:
        return None
    return RunOptions.from_json(started.get("options"), started.get("version"))


def _tune(
    opts: RunOptions, phase: Phase, resume: Path | None, collectors: RayCollectors | None
) -> RunOutcome | V1RunOutcome:
    record, opts = _open_record(opts, resume)
    try:
        if resume is not None:  # we hold the lock: a live server of this run is our orphan
            stop_own_orphans(record.path, opts.stop_grace_s, lambda msg: phase("resume", msg))
        v1 = engine_for(opts)
        if v1 is not None:
            return tune_v1_recorded(record, opts, phase, v1)
        return _tune_recorded(record, opts, phase, collectors)
    except PretunerError as err:
        err.run_record = record.path  # `run --json` names it
        raise
    except KeyboardInterrupt:
        raise RunInterrupted(record.path) from None
    except OSError as err:
        if is_disk_full(err):
            raise disk_full_error(err, record.path) from None
        raise
    finally:
        if record.lock is not None:
            record.lock.release()


def _tune_recorded(
    record: RunRecord, opts: RunOptions, phase: Phase, collectors: RayCollectors | None
) -> RunOutcome:
    cfg, choice, ctx, serve_argv, _ = _setup(opts)
    if collectors is not None:
        ctx = replace(ctx, collector=collectors)
        record.append("cluster", **collectors.info)
    phase("record", str(record.path))
    if ctx.device_reader is None:
        phase("device", NO_READER)
    tuner = Tuner(
        cfg,
        recorded_executor(record, ctx, phase),
        phase,
        on_decision=lambda d: record.append("decision", **d),
    )
    meta = RunMeta(
        run_id=record.path.name,
        backend=choice.backend.value,
        simulated=choice.simulated,
        card_source=cfg.card.source,
        model_arg=server_model_arg(opts.model, cfg.model, choice.backend),
        kv_cache_dtype=cfg.kv_cache_dtype,
        cluster=collectors.info if collectors is not None else None,
        asked_max_model_len=cfg.max_model_len,
        retune_command=tuple(opts.command_line()),
        engine_version=choice.engine_version, engine_reason=choice.reason,
        device_kind=DEVICE_KINDS[choice.backend],
    )
    try:
        result = tuner.run()
    except BaseException as err:
        record.append("run_stopped", error=f"{type(err).__name__}: {err}")
        if isinstance(err, PretunerError):  # not on Ctrl-C: that run stays resumable
            record_failure(record, tuner, err, meta)
        raise
    rep = report_json(result, meta, serve_argv)
    write_report(record, rep)
    record.append("run_finished", validated=result.validated)
    return RunOutcome(record.path, rep, result, choice)
