"""The pinned-KV method's `Setup` (engine, device, layout, launch context, a vision-language
model's images) and `PinnedMethod`, the V1 loop as the pipeline in `pretuner.tune.entry` runs it."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretuner.devices import select_reader
from pretuner.devices.cpu import host_memory
from pretuner.devices.npu_smi import CardInfo
from pretuner.emulation import emulator
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import Executor
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import Soak
from pretuner.engines.v1_launch import V1Hooks
from pretuner.engines.vllm_v1 import ROWS, V1Engine, V1Row, parse_server_args
from pretuner.errors import BadInputError, InfeasibleError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.launch.images import image_shape
from pretuner.models import resolve
from pretuner.models.spec import ModelSpec
from pretuner.models.vision import VLLM_DEFAULT_MM_LIMIT, parse_limit_mm_per_prompt
from pretuner.plan.layout import PlanConfig, v1_layout_options
from pretuner.plan.propose import decide_layout
from pretuner.report.records import Method as MethodName
from pretuner.report.records import RunReport
from pretuner.tune.busy import refuse_busy_devices
from pretuner.tune.execute import Phase
from pretuner.tune.pinned.loop import V1Config, V1Result, V1Tuner
from pretuner.tune.pinned.report import PinnedFacts, pinned_layout, report_json
from pretuner.tune.pinned.weights import (
    check_host,
    knobs_of,
    weights_record,
    widen_hint,
)
from pretuner.tune.report import RunMeta
from pretuner.tune.setup import OnDecision, Setup, Vision, launch_context
from pretuner.units import MIB

if TYPE_CHECKING:
    from pretuner.tune.options import RunOptions

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
MAX_NUM_SEQS = 4096
# A vision-language model's validation runs this soak unless --soak/--soak-minutes say
# otherwise: memory that grows with distinct images shows within a few hundred requests.
DEFAULT_SOAK = 200


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
        return Vision(shape, Soak(), tuple(flags), True, opts.mm_processor_cache_gb)
    requests = opts.soak if opts.soak is not None else (
        DEFAULT_SOAK if opts.soak_minutes is None else None)
    return Vision(shape, Soak(requests, opts.soak_minutes), tuple(flags), limit is not None,
                  opts.mm_processor_cache_gb)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


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


def pinned_layout_options(opts: RunOptions, choice: EngineChoice) -> PlanConfig:
    """What `pretuner plan` decides on for a V1 run of `opts` (the checks `run` makes)."""
    opts.check()
    knobs, _ = knobs_of(opts, parse_server_args(opts.server_args))
    spec = resolve(opts.model)
    vision_setup(opts, spec)  # a text model refuses the image options
    return v1_layout_options(opts, ROWS[choice.name], choice.simulated, spec, knobs)


def pinned_setup(opts: RunOptions, choice: EngineChoice) -> Setup[V1Config]:
    opts.check()
    row = ROWS[choice.name]
    seqs, batched = _check(opts, row)
    knobs, server_args = knobs_of(opts, parse_server_args(opts.server_args))
    _check_weights(opts.model, choice.simulated, server_args)
    spec = resolve(opts.model)
    vision = vision_setup(opts, spec)
    layout = v1_layout_options(opts, row, choice.simulated, spec, knobs)
    card = layout.card_gib
    sim_env = ({**emulator().launch_env("v1", card, opts.seed, os.environ), **opts.sim_env}
               if choice.simulated else dict(opts.sim_env))
    # A local model folder needs no hub: the server is told so (no network call, no wait).
    local = not choice.simulated and Path(opts.model).is_dir()
    engine = V1Engine(row, choice.simulated, choice.version, sim_env, python=choice.python,
                      server_args=server_args, server_env={"HF_HUB_OFFLINE": "1"} if local else {},
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
    model_arg = engine.model_arg(opts.model, spec)
    budget = engine.budget_bytes(card)
    reader = select_reader(engine.device_kind, {**os.environ, **sim_env}, p.tp * p.pp,
                           budget_mib=budget // MIB if budget is not None else None)
    ctx = launch_context(opts, engine, model_arg, spec.name, reader,
                         hooks=V1Hooks(bpt, vision.images, vision.soak))
    card_info = CardInfo(card, None,
                         "--card" if opts.card_gib is not None else "the device's size")
    facts = PinnedFacts(
        engine=engine, model=spec.name, card_gib=card, bytes_per_token=bpt,
        asked_max_num_seqs=seqs, weights_format=p.weights_format,
        vision=None if vision.images is None else vision,
        weights=weights_record(p, knobs, host, None), min_tokens_per_s=opts.min_tokens_per_s)

    def start(execute: Executor, phase: Phase, on_decision: OnDecision) -> PinnedMethod:
        return PinnedMethod(cfg, execute, phase, on_decision, setup=setup, facts=facts,
                            host_line=host_line)

    setup = Setup(choice, engine, spec, model_arg, ctx, card_info, p.layout_reason, cfg, start,
                  vision)
    return setup


class PinnedMethod(V1Tuner):
    """The pinned-KV loop as the pipeline drives it."""

    name: MethodName = "v1-pinned-kv"
    then = ("read the engine's own profile and the device's peak, pin --kv-cache-memory-bytes "
            "below them by the measured margin, and validate with max-num-seqs concurrent "
            "max-length requests (launch 2).")

    def __init__(self, cfg: V1Config, execute: Executor, phase: Phase, on_decision: OnDecision,
                 *, setup: Setup[V1Config], facts: PinnedFacts, host_line: str | None) -> None:
        super().__init__(cfg, execute, phase, on_decision)
        self.setup, self.facts, self.host_line = setup, facts, host_line

    def begin(self) -> None:
        engine = self.facts.engine
        self.phase("engine", self.setup.choice.reason)
        if self.setup.ctx.device_reader is None:
            self.phase("device", "no device memory reader here: the engine's own profiling "
                       "will be pinned, nothing measured beyond it")
        refuse_busy_devices(engine, self.setup.ctx.device_reader, self.cfg.util)
        self.decide("layout", self.setup.layout_reason, tp=self.cfg.tp, pp=self.cfg.pp)
        if engine.knobs.active:
            self.decide("weights", f"{engine.knobs.words()}: the same in every launch"
                        + (f"; {self.host_line}" if self.host_line else ""),
                        **engine.knobs.to_json())

    def run(self) -> V1Result:
        try:
            return super().run()
        except InfeasibleError as err:
            widen_hint(err, self.facts.engine.knobs)
            raise

    def first_launch(self) -> LaunchSettings:
        return self.settings(Purpose.PRERUN, self.cfg.util, self.prerun_kv())

    def report_json(self, result: V1Result, meta: RunMeta) -> RunReport:
        return report_json(result, meta, self.facts)

    def layout(self) -> dict[str, Any]:
        return pinned_layout(self.facts, self.cfg.tp, self.cfg.pp)
