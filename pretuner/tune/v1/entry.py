"""The pinned-KV method's setup (engine, device, layout, launch context) and its journaled
loop: the V1 family's half of the one pipeline in `pretuner.tune.entry`."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretuner.devices import select_reader
from pretuner.devices.cpu import HostMemory, host_memory
from pretuner.engines.base import LaunchCommand, LaunchSettings, Purpose, Target
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import Soak
from pretuner.engines.v1_launch import V1Hooks
from pretuner.engines.vllm_v1 import ROWS, V1Engine, V1Row, parse_server_args
from pretuner.errors import BadInputError, InfeasibleError, PretunerError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.launch.images import ImageShape, image_shape
from pretuner.models import local_model_path, resolve
from pretuner.models.spec import ModelSpec
from pretuner.models.vision import VLLM_DEFAULT_MM_LIMIT, parse_limit_mm_per_prompt
from pretuner.plan.layout import PlanResult, v1_layout_options
from pretuner.plan.propose import decide_layout
from pretuner.report.records import RunReport
from pretuner.tune.busy import refuse_busy_devices
from pretuner.tune.execute import LaunchContext, Phase
from pretuner.tune.record import RunRecord
from pretuner.tune.report import write_failure, write_report
from pretuner.tune.v1 import report as v1report
from pretuner.tune.v1.loop import V1Config, V1Result, V1Tuner
from pretuner.tune.v1.report_memory import VisionMeta
from pretuner.tune.v1.weights import (
    check_host,
    knobs_of,
    weights_record,
    widen_hint,
)
from pretuner.units import MIB

if TYPE_CHECKING:
    from pretuner.tune.entry import RunOptions

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
MAX_NUM_SEQS = 4096
# A vision-language model's validation runs this soak unless --soak/--soak-minutes say
# otherwise: memory that grows with distinct images shows within a few hundred requests.
DEFAULT_SOAK = 200


@dataclass(frozen=True, slots=True)
class V1Setup:
    cfg: V1Config
    ctx: LaunchContext
    engine: V1Engine
    spec: ModelSpec
    model_arg: str
    choice: EngineChoice
    layout_reason: str
    plan: PlanResult  # the weights as loaded and offloaded (predicted)
    host: HostMemory | None  # read when a weights knob is given
    host_line: str | None  # what offload costs the host, for the run's decisions
    images: ImageShape | None = None  # a vision-language model's; None: text only
    soak: Soak = Soak()
    image_limit_given: bool = False  # --limit-mm-per-prompt named the image count


@dataclass(frozen=True, slots=True)
class Vision:
    """What a vision-language model adds to a V1 run."""

    images: ImageShape | None
    soak: Soak
    flags: tuple[tuple[str, str | None], ...]
    limit_given: bool


def vision_setup(opts: RunOptions, spec: ModelSpec) -> Vision:
    """The image shape, the soak and the server flags of a vision-language model; a text
    model refuses the image options (exit 2)."""
    asked = [flag for flag, value in (("--limit-mm-per-prompt", opts.limit_mm_per_prompt),
                                      ("--mm-processor-cache-gb", opts.mm_processor_cache_gb))
             if value is not None] + (["--soak"] if opts.soak else []) + (
        ["--soak-minutes"] if opts.soak_minutes else [])
    if spec.vision is None:
        if asked:
            raise BadInputError(f"{', '.join(asked)}: {spec.name} is a text model (its config "
                                "has no vision tower), these are for vision-language models",
                                hint=f"drop {' '.join(asked)}, or tune a vision-language model "
                                "(e.g. qwen3-vl-8b)")
        return Vision(None, Soak(), (), False)
    flags: list[tuple[str, str | None]] = []
    limit: int | None = None
    if opts.limit_mm_per_prompt is not None:
        limits = parse_limit_mm_per_prompt(opts.limit_mm_per_prompt)
        limit = limits.get("image")
        flags.append(("--limit-mm-per-prompt", json.dumps(limits, separators=(",", ":"))))
    if opts.mm_processor_cache_gb is not None:
        flags.append(("--mm-processor-cache-gb", f"{opts.mm_processor_cache_gb:g}"))
    shape = image_shape(spec.vision, VLLM_DEFAULT_MM_LIMIT if limit is None else limit)
    if shape.is_text_only:
        return Vision(shape, Soak(), tuple(flags), True)
    requests = opts.soak if opts.soak is not None else (
        DEFAULT_SOAK if opts.soak_minutes is None else None)
    return Vision(shape, Soak(requests, opts.soak_minutes), tuple(flags), limit is not None)


@dataclass(frozen=True, slots=True)
class V1RunOutcome:
    record: Path
    report: RunReport  # report.json is report.model_dump(mode="json")
    result: V1Result
    choice: EngineChoice


def _sim_env(opts: RunOptions, card_gib: int) -> dict[str, str]:
    from pretuner.emulation import emulator

    return {**emulator().launch_env("v1", card_gib, opts.seed, os.environ), **opts.sim_env}


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def _server_env(model: str, simulated: bool) -> dict[str, str]:
    """A local model folder needs no hub: the server is told so (no network call, no wait)."""
    return {} if simulated or not Path(model).is_dir() else {"HF_HUB_OFFLINE": "1"}


def _check_weights(model: str, simulated: bool, flags: tuple[tuple[str, str | None], ...]) -> None:
    folder = Path(model)
    if simulated or not folder.is_dir() or any(name == "--load-format" for name, _ in flags):
        return
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise BadInputError(f"the model folder {model} has no weights (no *.safetensors, *.bin)",
                            hint="serve random weights of the config's shapes with "
                            "--server-arg '--load-format dummy', or add the checkpoint")


def _check(opts: RunOptions, row: V1Row) -> tuple[int, int]:
    from pretuner import validate as v

    seqs = opts.max_num_seqs if opts.max_num_seqs is not None else (
        row.default_max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    v.int_range("--max-num-seqs", seqs, 1, MAX_NUM_SEQS)
    if opts.max_num_batched_tokens is not None:
        v.int_range("--max-num-batched-tokens", opts.max_num_batched_tokens, seqs)
    if opts.model_use_gib is not None:
        raise BadInputError("--model-use-gb is vLLM-MindSpore r0.1's variable; a V1 engine "
                            "takes --kv-cache-memory-bytes, which pretuner derives",
                            hint="drop --model-use-gb")
    return seqs, opts.max_num_batched_tokens or 0


def v1_setup(opts: RunOptions, choice: EngineChoice) -> V1Setup:
    opts.check()
    row = ROWS[choice.name]
    seqs, batched = _check(opts, row)
    knobs, server_args = knobs_of(opts, parse_server_args(opts.server_args))
    _check_weights(opts.model, choice.simulated, server_args)
    spec = resolve(opts.model)
    vision = vision_setup(opts, spec)
    layout = v1_layout_options(opts, row, choice.simulated, spec, knobs)
    card = layout.card_gib
    sim_env = _sim_env(opts, card) if choice.simulated else dict(opts.sim_env)
    engine = V1Engine(row, choice.simulated, choice.version, sim_env, python=choice.python,
                      server_args=server_args,
                      server_env=_server_env(opts.model, choice.simulated),
                      mm_flags=vision.flags,
                      tuning_env=dict(row.dev_env) if vision.soak.on else {},
                      knobs=knobs, serve_cmd=tuple(shlex.split(opts.serve_cmd or "")))
    max_len, block = layout.max_model_len, layout.block_size
    p = decide_layout(layout)
    if opts.ray_address:
        raise BadInputError("--ray-address: pretuner drives V1 engines on one node so far",
                            hint="drop --ray-address, or use the r0.1 method for multi-node "
                            "(--engine vllm-mindspore-r01 --ray-address ...)")
    host = host_memory(engine.device_kind, {**os.environ, **sim_env}) if knobs.active else None
    host_line = check_host(p, knobs, host)
    bpt = kv_bytes_per_token(spec, tp=p.tp, pp=p.pp, kv_dtype=opts.kv_cache_dtype)
    cfg = V1Config(model=spec, card_gib=card, bytes_per_token=bpt, util=opts.util,
                   max_model_len=max_len, max_num_seqs=seqs,
                   max_num_batched_tokens=batched or row.default_batched_tokens,
                   block_size=block, tp=p.tp, pp=p.pp,
                   kv_cache_dtype=opts.kv_cache_dtype, max_launches=opts.max_launches,
                   validate=opts.validate, profile_prerun=row.profile_prerun or choice.simulated)
    model_arg = local_model_path(opts.model) or (
        opts.model if engine.simulated else (spec.hf_id or opts.model))
    served = spec.name

    def build(settings: LaunchSettings, port: int) -> LaunchCommand:
        return engine.command(settings, Target(model_arg, served, opts.host, port))

    budget = engine.budget_bytes(card)
    reader = select_reader(engine.device_kind, {**os.environ, **sim_env}, p.tp * p.pp,
                           budget_mib=budget // MIB if budget is not None else None)
    ctx = LaunchContext(build=build, served_name=served, host=opts.host,
                        ready_timeout_s=opts.ready_timeout_s,
                        request_timeout_s=opts.request_timeout_s,
                        stop_grace_s=opts.stop_grace_s, seed=opts.seed, device_reader=reader,
                        hooks=V1Hooks(bpt, vision.images, vision.soak))
    return V1Setup(cfg, ctx, engine, spec, model_arg, choice, p.layout_reason, p, host,
                   host_line, vision.images, vision.soak, vision.limit_given)


def vision_meta(setup: V1Setup, opts: RunOptions) -> VisionMeta | None:
    if setup.images is None:
        return None
    flags = tuple(part for name, value in setup.engine.mm_flags
                  for part in (name, *(() if value is None else (value,))))
    return VisionMeta(setup.images, setup.soak, setup.image_limit_given,
                      opts.mm_processor_cache_gb, flags)


def first_launch(setup: V1Setup) -> tuple[LaunchSettings, LaunchCommand]:
    """What `--dry-run` shows: the pre-run's settings and command."""
    tuner = V1Tuner(setup.cfg, _no_launch, lambda phase, detail: None)
    s = tuner.settings(Purpose.PRERUN, setup.cfg.util, tuner.prerun_kv())
    return s, setup.ctx.build(s, 0)


def _no_launch(settings: LaunchSettings) -> Any:
    raise AssertionError("a dry run launches nothing")


def tune_v1_recorded(record: RunRecord, opts: RunOptions, phase: Phase,
                     choice: EngineChoice) -> V1RunOutcome:
    from pretuner.tune.loop import recorded_executor

    setup = v1_setup(opts, choice)
    phase("record", str(record.path))
    phase("engine", choice.reason)
    if setup.ctx.device_reader is None:
        phase("device", "no device memory reader here: the engine's own profiling will be "
              "pinned, nothing measured beyond it")
    refuse_busy_devices(setup.engine, setup.ctx.device_reader, setup.cfg.util)
    tuner = V1Tuner(setup.cfg, recorded_executor(record, setup.ctx, phase), phase,
                    on_decision=lambda d: record.append("decision", **d))
    tuner.decide("layout", setup.layout_reason, tp=setup.cfg.tp, pp=setup.cfg.pp)
    if setup.engine.knobs.active:
        tuner.decide("weights", f"{setup.engine.knobs.words()}: the same in every launch"
                     + (f"; {setup.host_line}" if setup.host_line else ""),
                     **setup.engine.knobs.to_json())
    meta = v1report.V1Meta(
        run_id=record.path.name, engine=choice.name, engine_version=choice.version,
        engine_reason=choice.reason, simulated=choice.simulated, model=setup.spec.name,
        model_arg=setup.model_arg, card_gib=setup.cfg.card_gib,
        bytes_per_token=setup.cfg.bytes_per_token,
        serve_command=tuple(setup.engine.serve_command(setup.cfg.card_gib)),
        device_kind=setup.engine.device_kind,
        deployment=setup.engine.deploy(tuner.settings(Purpose.VALIDATE, opts.util, None)),
        asked_max_model_len=setup.cfg.max_model_len,
        asked_max_num_seqs=setup.cfg.max_num_seqs,
        retune_command=tuple(opts.command_line()),
        vision=vision_meta(setup, opts),
        weights=weights_record(setup.plan, setup.engine.knobs, setup.host, None),
        min_tokens_per_s=opts.min_tokens_per_s,
        card_source="--card" if opts.card_gib is not None else "the device's size",
        weights_format=setup.plan.weights_format, kv_cache_dtype=setup.cfg.kv_cache_dtype,
    )
    try:
        result = tuner.run()
    except BaseException as err:
        if isinstance(err, InfeasibleError):
            widen_hint(err, setup.engine.knobs)
        record.append("run_stopped", error=f"{type(err).__name__}: {err}")
        if isinstance(err, PretunerError):
            failure = v1report.failure_json(err, meta, tuner.outcomes, tuner.decisions,
                                            setup.cfg.tp, setup.cfg.pp)
            write_failure(record, failure, err)
        raise
    meta = _with_deployment(meta, setup.engine.deploy(result.final))
    rep = v1report.report_json(result, meta)
    write_report(record, rep)
    record.append("run_finished", validated=result.validated)
    return V1RunOutcome(record.path, rep, result, choice)


def _with_deployment(meta: v1report.V1Meta, deployment: Any) -> v1report.V1Meta:
    from dataclasses import replace

    return replace(meta, deployment=deployment)
