"""`run_tuning(opts)`: the entrypoint behind `pretuner run` (typed config in, result out).

One pipeline for every engine: the registry names the engine (`pretuner.engines.registry`),
the run folder and its journal are opened, orphans of an earlier run are stopped, the engine's
family picks the tuning method (r0.1: `_setup` here and `tune.loop.Tuner`; V1: `tune.v1`), the
method's proof runs under full load, and one typed report and the start files are written.
What does not depend on the engine lives here or in the modules it calls, once: resume, dry run,
the busy-device refusal, `--serve-cmd`, provenance, redaction, exit codes.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pretuner import __version__
from pretuner.devices import select_reader
from pretuner.devices.npu_smi import detect_card
from pretuner.engines.base import Family, LaunchCommand, LaunchSettings, Target
from pretuner.engines.mindspore_r01 import BLOCK_SIZE, R01Engine
from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.registry import choose_engine
from pretuner.errors import BadInputError, PretunerError, RunInterrupted
from pretuner.launch.process import check_server_installed
from pretuner.method import check_launch_settings
from pretuner.models import builtin_specs, resolve
from pretuner.report.records import RunReport
from pretuner.tune.config import pool_on_demand
from pretuner.tune.execute import LaunchContext, Phase
from pretuner.tune.failure import record_failure
from pretuner.tune.layout import check_r01_flags
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
from pretuner.tune.ownership import (
    check_no_orphans,
    claim_new_folder,
    disk_full_error,
    is_disk_full,
    lock_folder,
    stop_own_orphans,
)
from pretuner.tune.record import RunRecord, check_folder_name
from pretuner.tune.report import RunMeta, report_json, write_report
from pretuner.tune.v1.entry import (
    V1RunOutcome,
    V1Setup,
    first_launch,
    tune_v1_recorded,
    v1_setup,
)

if TYPE_CHECKING:
    from pretuner.cluster.session import RayCollectors

log = logging.getLogger(__name__)

NO_READER = "no device memory reader here: measuring from the logs only"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    record: Path
    report: RunReport  # report.json is report.model_dump(mode="json")
    result: TuneResult
    engine: R01Engine


@dataclass(frozen=True, slots=True)
class DryRun:
    """What a run's first launch would be, on any engine: nothing launched, nothing written."""

    method: str  # "r0.1" or "v1-pinned-kv"
    engine: str
    reason: str  # why this engine (the registry's words)
    simulated: bool
    card: CardInfo
    layout_reason: str
    device_reader: str | None
    prerun: LaunchSettings
    command: LaunchCommand
    then: str  # what the run does after the pre-run
    vision: V1Setup | None = None  # a vision-language model's images and soak (V1)


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


@dataclass(frozen=True, slots=True)
class R01Setup:
    """Everything an r0.1 run needs before its first launch."""

    cfg: TuneConfig
    engine: R01Engine
    ctx: LaunchContext
    serve_argv: list[str]  # the server command with its model, before the tuned flags


def _setup(opts: RunOptions, engine: R01Engine, card: CardInfo | None = None) -> R01Setup:
    opts.check()
    check_r01_flags(opts)
    spec = resolve(opts.model)
    engine.check_model(spec, opts.tp, opts.pp,
                       [s.name for s in builtin_specs() if s.eager_attention])
    lengths = engine.lengths
    max_len = lengths.max_model_len if opts.max_model_len is None else opts.max_model_len
    min_len = (
        min(lengths.min_model_len, max_len) if opts.min_model_len is None else opts.min_model_len
    )
    _check_lengths(max_len, min_len)

    def card_env(weights_format: str, nodes: int) -> dict[str, str]:
        env = engine.card_env(opts.card_gib, opts.seed, os.environ,
                              weights_format=weights_format, nodes=nodes)
        return {**env, **opts.sim_env}

    if card is None:
        base_env = card_env(spec.weights_format(opts.weights_format).name, 1)
        source = "emulated npu-smi" if engine.simulated else "npu-smi"
        card = detect_card(engine.smi_command(), source, opts.card_gib,
                           {**os.environ, **base_env})
    cfg = TuneConfig(
        model=spec,
        card=card,
        util=opts.util,
        max_model_len=max_len,
        min_model_len=min_len,
        tp=1 if engine.device_kind == "cpu" else opts.tp,
        pp=opts.pp,
        nodes=opts.nodes,
        block_size=BLOCK_SIZE if opts.block_size is None else opts.block_size,
        kv_cache_dtype=opts.kv_cache_dtype,
        weights_format=opts.weights_format,
        headroom_gib=opts.headroom_gib,
        reserve_gib=opts.reserve_gib,
        max_launches=opts.max_launches,
        validate=opts.validate,
        model_use_gib=opts.model_use_gib,
        len_ladder=lengths.ladder,
        provenance="simulated" if engine.simulated else "measured",
    )
    if opts.model_use_gib is not None:
        check_launch_settings(card.card_gib, prerun_util(cfg), opts.model_use_gib)
    p = plan_for(cfg)
    extra_env = card_env(p.weights_format, p.nodes)
    cfg = replace(cfg, pool_on_demand=pool_on_demand({**os.environ, **extra_env}))
    if opts.serve_cmd is not None and not shlex.split(opts.serve_cmd):
        raise BadInputError("--serve-cmd is empty", hint="e.g. --serve-cmd 'my-wrapper serve'")
    engine = replace(engine, serve_cmd=tuple(shlex.split(opts.serve_cmd or "")), nodes=p.nodes,
                     launch_env=extra_env)
    if not engine.serve_cmd:
        check_server_installed(engine.base_command()[0])
    served = spec.name
    target = Target(engine.model_arg(opts.model, spec), served, opts.host, 0)

    def build(settings: LaunchSettings, port: int) -> LaunchCommand:
        return engine.command(settings, replace(target, port=port))

    ctx = LaunchContext(
        build=build,
        served_name=served,
        host=opts.host,
        ready_timeout_s=opts.ready_timeout_s,
        request_timeout_s=opts.request_timeout_s,
        stop_grace_s=opts.stop_grace_s,
        seed=opts.seed,
        decode_tokens=lengths.decode_tokens,
        device_reader=select_reader(engine.device_kind, {**os.environ, **extra_env}, p.tp * p.pp),
    )
    base, model_as_flag = engine.base_command()
    return R01Setup(cfg, engine, ctx,
                    [*base, *(["--model", target.model] if model_as_flag else [target.model])])


def dry_run(opts: RunOptions) -> DryRun:
    """What the first launch would be, without launching anything or writing a record."""
    choice = choose_engine(opts.engine)  # each setup checks the options
    if choice.family is Family.V1:
        v1 = v1_setup(opts, choice)
        settings, command = first_launch(v1)
        reader = v1.ctx.device_reader
        card = CardInfo(v1.cfg.card_gib, None,
                        "--card" if opts.card_gib is not None else "the device's size")
        return DryRun("v1-pinned-kv", choice.name, choice.reason, choice.simulated, card,
                      v1.layout_reason, reader.name if reader else None, settings, command,
                      V1_THEN, v1 if v1.images is not None else None)
    setup = _setup(opts, choice.r01())
    tuner = Tuner(setup.cfg, _no_launch, lambda phase, detail: None)
    settings = tuner.prerun_settings(prerun_util(setup.cfg), setup.cfg.max_model_len)
    reader = setup.ctx.device_reader
    return DryRun("r0.1", choice.name, choice.reason, choice.simulated, setup.cfg.card,
                  tuner.plan.layout_reason, reader.name if reader else None, settings,
                  setup.ctx.build(settings, 0), R01_THEN)


R01_THEN = ("read every rank's `actual peak used` after a graceful stop, derive, and validate "
            "with max-num-seqs concurrent max-length requests (launch 2).")
V1_THEN = ("read the engine's own profile and the device's peak, pin --kv-cache-memory-bytes "
           "below them by the measured margin, and validate with max-num-seqs concurrent "
           "max-length requests (launch 2).")


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


def run_tuning(
    opts: RunOptions, phase: Phase, resume: Path | None = None
) -> RunOutcome | V1RunOutcome:
    """Tune, journal every launch and decision, and write the result files."""
    asked = opts if resume is None else _recorded_options(resume)
    choice = choose_engine(asked.engine) if asked is not None else None
    if choice is not None and choice.family is Family.V1:
        if resume is None:
            v1_setup(opts, choice)  # refuse bad input before a run folder exists
        return _tune(opts, phase, resume, None)
    if resume is None and choice is not None:
        _setup(opts, choice.r01())  # refuse bad input before a run folder exists
    if asked is None or choice is None or not asked.ray_address:
        return _tune(opts, phase, resume, None)
    # Multi-node: the cluster is checked before a run folder exists, and stays connected.
    from pretuner.cluster.session import ClusterPlan, ray_cluster

    p = plan_for(_setup(asked, choice.r01()).cfg)
    plan = ClusterPlan(p.tp * p.pp, p.nodes, emulated=choice.simulated)
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
        choice = choose_engine(opts.engine)
        if choice.family is Family.V1:
            return tune_v1_recorded(record, opts, phase, choice)
        return _tune_recorded(record, opts, phase, choice.r01(), collectors)
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
    record: RunRecord, opts: RunOptions, phase: Phase, engine: R01Engine,
    collectors: RayCollectors | None
) -> RunOutcome:
    setup = _setup(opts, engine)
    cfg, ctx = setup.cfg, setup.ctx
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
        backend=engine.server,
        simulated=engine.simulated,
        card_source=cfg.card.source,
        model_arg=engine.model_arg(opts.model, cfg.model),
        kv_cache_dtype=cfg.kv_cache_dtype,
        cluster=collectors.info if collectors is not None else None,
        asked_max_model_len=cfg.max_model_len,
        retune_command=tuple(opts.command_line()),
        engine_version=engine.version, engine_reason=engine.reason,
        device_kind=engine.device_kind,
    )
    try:
        result = tuner.run()
    except BaseException as err:
        record.append("run_stopped", error=f"{type(err).__name__}: {err}")
        if isinstance(err, PretunerError):  # not on Ctrl-C: that run stays resumable
            record_failure(record, tuner, err, meta)
        raise
    rep = report_json(result, meta, setup.serve_argv)
    write_report(record, rep)
    record.append("run_finished", validated=result.validated)
    return RunOutcome(record.path, rep, result, engine)
