"""`run_tuning(opts)`: the entrypoint behind `pretuner run` (typed config in, result out).

One pipeline for every engine: the registry names the engine (`pretuner.engines.registry`),
the run folder and its journal are opened, orphans of an earlier run are stopped, the engine's
family picks the tuning method (`tune.r01` or `tune.pinned`, each giving one `tune.setup.Setup`),
the method's proof runs under full load, and one typed report and the start files are written.
What does not depend on the engine lives here or in the modules it calls, once: resume, dry run,
the busy-device refusal, `--serve-cmd`, provenance, redaction, exit codes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pretuner import __version__
from pretuner.devices.base import device_name
from pretuner.engines.base import Family, LaunchCommand, LaunchSettings
from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.registry import EngineChoice, choose_engine
from pretuner.errors import BadInputError, PretunerError, RunInterrupted
from pretuner.files import scrub
from pretuner.plan.layout import PlanConfig
from pretuner.report.records import RunReport
from pretuner.tune.execute import Phase, recorded_executor
from pretuner.tune.options import RunOptions as RunOptions
from pretuner.tune.pinned.loop import V1Config, V1Result
from pretuner.tune.pinned.setup import pinned_layout_options, pinned_setup
from pretuner.tune.r01.config import TuneConfig, TuneResult, plan_for
from pretuner.tune.r01.setup import r01_layout_options, r01_setup
from pretuner.tune.record import (
    RunRecord,
    check_no_orphans,
    claim_new_folder,
    folder_error,
    lock_folder,
    stop_own_orphans,
)
from pretuner.tune.report import RunMeta, record_failure, write_report
from pretuner.tune.setup import Method, Setup

if TYPE_CHECKING:
    from pretuner.cluster.session import RayCollectors

log = logging.getLogger(__name__)
AnySetup = Setup[TuneConfig] | Setup[V1Config]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    record: Path
    report: RunReport  # report.json is report.model_dump(mode="json")
    result: TuneResult | V1Result


@dataclass(frozen=True, slots=True)
class DryRun:
    """What a run's first launch would be, on any engine: nothing launched, nothing written."""

    setup: AnySetup
    method: Method  # its name ("r0.1" or "v1-pinned-kv") and what it does after the pre-run
    prerun: LaunchSettings
    command: LaunchCommand


# The one place the method is chosen: its setup, and its layout options for `pretuner plan`.
METHODS: dict[Family, tuple[Callable[[RunOptions, EngineChoice], AnySetup],
                            Callable[[RunOptions, EngineChoice], PlanConfig]]] = {
    Family.R01: (r01_setup, r01_layout_options), Family.V1: (pinned_setup, pinned_layout_options)}


def choose(opts: RunOptions, launch: bool = True) -> EngineChoice:
    """The engine `opts` names (`pretuner.engines.registry`); `plan` launches nothing."""
    return choose_engine(opts.engine, emulate=opts.emulate, python=opts.engine_python,
                         wrapped=opts.serve_cmd is not None, launch=launch)


def setup(opts: RunOptions, choice: EngineChoice) -> AnySetup:
    """The run's setup; bad input is refused here (exit 2), before a run folder exists."""
    return METHODS[choice.family][0](opts, choice)


def run_layout_options(opts: RunOptions) -> PlanConfig:
    """The layout options a run of `opts` decides on (`pretuner plan`), bad input refused as
    `run` refuses it."""
    choice = choose(opts, launch=False)
    return METHODS[choice.family][1](opts, choice)


def dry_run(opts: RunOptions) -> DryRun:
    """What the first launch would be, without launching anything or writing a record."""
    s = setup(opts, choose(opts))
    method = s.start(_no_launch, lambda phase, detail: None, None)
    settings = method.first_launch()
    return DryRun(s, method, settings, s.ctx.build(settings, 0))


def _no_launch(settings: LaunchSettings) -> LaunchOutcome:
    raise AssertionError("a dry run launches nothing")


def _open_record(opts: RunOptions, resume: Path | None) -> tuple[RunRecord, RunOptions]:
    if resume is not None:
        record = RunRecord.open(resume)
        record.lock = lock_folder(record.path)  # a second --resume of this run is refused
        return record, _recorded_options(record)
    if opts.out is not None:
        out = Path(opts.out)
        check_no_orphans(out.parent, own=out)  # a server a killed run left on the card
        record = RunRecord(path=out, lock=claim_new_folder(out))  # new or empty, and locked
    else:
        check_no_orphans(Path(opts.runs_dir))
        record = RunRecord.create(Path(opts.runs_dir), opts.model, opts.card_gib)
    record.append("run_started", options=opts.to_json(), version=__version__)
    return record, opts


def run_tuning(opts: RunOptions, phase: Phase, resume: Path | None = None) -> RunOutcome:
    """Tune, journal every launch and decision, and write the result files."""
    asked = opts if resume is None else _recorded_options(RunRecord.open(resume))
    choice = choose(asked)
    s = None
    if resume is None:
        s = setup(opts, choice)  # refuse bad input before a run folder exists
        if choice.simulated and opts.engine == "auto" and not opts.emulate:
            log.warning("%s", choice.reason)  # the fallback: said before anything else
    if not asked.ray_address:
        return _tune(opts, phase, resume, None, choice, s)
    # Multi-node: the cluster is checked before a run folder exists, and stays connected.
    from pretuner.cluster.session import ClusterPlan, ray_cluster

    s = s or setup(asked, choice)
    if isinstance(s.cfg, TuneConfig):
        p = plan_for(s.cfg)
        world, nodes = p.tp * p.pp, p.nodes
    else:  # a V1 layout: TP x PP devices, --cards-per-node a node
        world = s.cfg.tp * s.cfg.pp
        nodes = -(-world // asked.cards_per_node)
    plan = ClusterPlan(world, nodes, emulated=choice.simulated, resource=s.engine.ray_resource,
                       device_kind=None if isinstance(s.cfg, TuneConfig)
                       else s.engine.device_kind, cards_per_node=asked.cards_per_node)
    with ray_cluster(asked.ray_address, plan, phase) as collectors:
        return _tune(opts, phase, resume, collectors, choice, s if resume is None else None)


def _recorded_options(record: RunRecord) -> RunOptions:
    """The options an unfinished run was started with (--resume goes on with them)."""
    started = next(record.of_kind("run_started"), None)
    if started is None:
        raise BadInputError(f"{str(record.path)!r} has no run_started entry",
                            hint="start a new run")
    if next(record.of_kind("run_finished"), None) is not None:
        raise BadInputError(
            f"run {str(record.path)!r} already finished", hint="start a new run instead"
        )
    return RunOptions.from_json(started.get("options"), started.get("version"))


def _tune(opts: RunOptions, phase: Phase, resume: Path | None,
          collectors: RayCollectors | None, choice: EngineChoice,
          s: AnySetup | None) -> RunOutcome:
    """`s`: the setup that refused bad input before the run folder (None on --resume, whose
    options come from the journal)."""
    record, opts = _open_record(opts, resume)
    try:
        if resume is not None:  # we hold the lock: a live server of this run is our orphan
            stop_own_orphans(record.path, opts.stop_grace_s, lambda msg: phase("resume", msg))
        return _tune_recorded(record, opts, phase, choice, collectors, s or setup(opts, choice))
    except PretunerError as err:
        err.run_record = record.path  # `run --json` names it
        raise
    except KeyboardInterrupt:
        raise RunInterrupted(record.path) from None
    except OSError as err:
        raise folder_error(err, record.path) from None
    finally:
        for server_log in record.path.glob("launch-*/server.log"):
            with contextlib.suppress(OSError):  # a server logs its own --api-key: not kept
                scrub(server_log)
        if record.lock is not None:
            record.lock.release()


def _tune_recorded(record: RunRecord, opts: RunOptions, phase: Phase, choice: EngineChoice,
                   collectors: RayCollectors | None, s: AnySetup) -> RunOutcome:
    ctx = s.ctx
    if collectors is not None:
        ctx = replace(ctx, collector=collectors)
        record.append("cluster", **collectors.info)
    phase("record", str(record.path))
    execute = recorded_executor(record, ctx, phase)

    def launch(settings: LaunchSettings) -> LaunchOutcome:
        # The engine's compile cache as it starts: what its log says it did (vLLM keys the
        # cache by --kv-cache-memory-bytes, so a folder that holds entries can still compile),
        # else whether the cache folder held anything.
        cache = s.engine.cache_state(os.environ)
        done = execute(settings)
        return replace(done, compile_cache=done.compile_cache or cache)

    method = s.start(launch, phase, lambda d: record.append("decision", **d))
    method.begin()
    meta = RunMeta(
        run_id=record.path.name, engine=s.engine.server, simulated=choice.simulated,
        card_source=s.card.source, model_arg=s.model_arg, kv_cache_dtype=s.cfg.kv_cache_dtype,
        cluster=collectors.info if collectors is not None else None,
        asked_max_model_len=s.cfg.max_model_len, retune_command=tuple(opts.command_line()),
        engine_version=choice.version, engine_reason=choice.reason,
        device_kind=s.engine.device_kind, stack=choice.stack,
        device_name=device_name(ctx.device_reader), engine_python=choice.python,
    )
    record.append("stack", engine=choice.name, version=choice.version, stack=choice.stack,
                  device_name=meta.device_name)
    try:
        result = method.run()
    except BaseException as err:
        record.append("run_stopped", error=f"{type(err).__name__}: {err}")
        if isinstance(err, PretunerError):  # not on Ctrl-C: that run stays resumable
            record_failure(record, method, err, meta)
        raise
    rep = method.report_json(result, meta)
    write_report(record, rep)
    record.append("run_finished", validated=result.validated)
    return RunOutcome(record.path, rep, result)
