"""The pinned-KV method's `Setup` (engine, device, layout, launch context, a vision-language
model's images, the weights knobs the host must hold) and `PinnedMethod`, the V1 loop as the
pipeline in `pretuner.tune.entry` runs it. The knobs (`--quantization`, `--cpu-offload-gb`,
`--swap-space`, `--enforce-eager`) are checked here and the same in every launch: the loop
derives and proves only the KV cache."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretuner import validate as v
from pretuner.devices import select_reader
from pretuner.devices.cpu import HostMemory, host_memory
from pretuner.devices.npu_smi import CardInfo
from pretuner.emulation import emulator
from pretuner.engines.base import Flag
from pretuner.engines.outcome import Executor
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import Soak
from pretuner.engines.v1_knobs import Knobs, gib_text
from pretuner.engines.v1_launch import V1Hooks
from pretuner.engines.vllm_v1 import ROWS, V1Engine, compile_cache_env, parse_server_args
from pretuner.errors import BadInputError, InfeasibleError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.launch.images import image_shape
from pretuner.models import resolve
from pretuner.models.quant import METHODS
from pretuner.models.spec import ModelSpec
from pretuner.models.vision import VLLM_DEFAULT_MM_LIMIT, parse_limit_mm_per_prompt
from pretuner.plan.layout import PlanConfig, PlanResult, v1_layout_options
from pretuner.plan.propose import decide_layout
from pretuner.report.records import Method as MethodName
from pretuner.report.records import RunReport, V1Weights
from pretuner.tune.busy import refuse_busy_devices
from pretuner.tune.execute import Phase
from pretuner.tune.pinned.loop import V1Config, V1Result, V1Tuner
from pretuner.tune.pinned.report import report_json
from pretuner.tune.report import RunMeta
from pretuner.tune.setup import OnDecision, Setup, Vision, launch_context
from pretuner.units import GIB, MIB

if TYPE_CHECKING:
    from pretuner.tune.options import RunOptions

SWAP_REFUSE_SHARE = 0.7  # vLLM refuses --swap-space x TP above this share of the host's total


def knobs_of(opts: RunOptions, server_args: tuple[Flag, ...] = ()) -> tuple[Knobs,
                                                                          tuple[Flag, ...]]:
    """The run's knobs, and the other server flags: a knob given as a --server-arg (as
    before pretuner knew them) is taken as if given as pretuner's own flag, once."""
    values: dict[str, str | None] = {}
    rest: list[Flag] = []
    own = opts.knobs_given()
    for name, value in server_args:
        if name not in own:
            rest.append((name, value))
            continue
        if own[name] or name in values:
            raise BadInputError(f"{name} is given twice (as pretuner's flag or a --config key, "
                                "and in --server-arg)", hint=f"give {name} once")
        values[name] = value
    try:
        offload = float(values.get("--cpu-offload-gb") or opts.cpu_offload_gib)
        swap = values.get("--swap-space")
        knobs = Knobs(
            (values.get("--quantization") or opts.quantization or "").lower() or None,
            offload, float(swap) if swap is not None else opts.swap_space_gib,
            opts.enforce_eager or "--enforce-eager" in values)
    except ValueError as err:
        raise BadInputError(f"--server-arg: {err}", hint="e.g. --cpu-offload-gb 14") from None
    if knobs.quantization is not None:
        v.choice("--quantization", knobs.quantization, METHODS)
    v.non_negative("--cpu-offload-gb", knobs.cpu_offload_gib, example="14")
    v.non_negative("--swap-space", knobs.swap_space_gib, example="4")
    return knobs, tuple(rest)


def check_host(p: PlanResult, knobs: Knobs, host: HostMemory | None) -> str | None:
    """Refuse (exit 4) offload or swap the host cannot hold; the line a decision records."""
    wp = p.weights_plan
    if wp is None or host is None:
        return None
    cards = p.tp * p.pp
    offload = wp.offload_bytes_per_card * cards
    swap = int(knobs.swap_gib * GIB) * p.tp
    if swap > SWAP_REFUSE_SHARE * host.total_bytes:
        most = int(SWAP_REFUSE_SHARE * host.total_bytes / GIB) // p.tp
        raise InfeasibleError(
            f"--swap-space {gib_text(knobs.swap_gib)} x TP{p.tp} = {swap / GIB:.2f} GiB is more "
            f"than {SWAP_REFUSE_SHARE:.0%} of the host's {host.total_bytes / GIB:.2f} GiB "
            f"({host.provenance}, {host.source}): vLLM refuses it at start-up",
            hint=f"use --swap-space {most} or less (the V1 engine preempts by recomputing; 0 is "
            "fine)")
    if offload > host.available_bytes:
        raise InfeasibleError(
            f"--cpu-offload-gb {gib_text(knobs.cpu_offload_gib)} keeps {offload / GIB:.2f} GiB of "
            f"weights in pinned host memory ({cards} card(s)), more than the "
            f"{host.available_bytes / GIB:.2f} GiB the host has available ({host.provenance}, "
            f"{host.source})",
            hint="lower --cpu-offload-gb (quantize with --quantization bitsandbytes first), free "
            "host memory, or use more cards (--tp)")
    if not offload:
        return None
    return (f"--cpu-offload-gb {gib_text(knobs.cpu_offload_gib)}: {offload / GIB:.2f} GiB of "
            f"weights in pinned host memory, {wp.card_weights_bytes / GIB:.2f} GiB per card left "
            f"on the card (predicted); host {host.words()}")


def weights_record(p: PlanResult, knobs: Knobs, host: HostMemory | None) -> V1Weights | None:
    """The run record's `weights` block, as planned (the proof adds what the engine loaded)."""
    wp = p.weights_plan
    if wp is None:
        return None
    cards = p.tp * p.pp
    return V1Weights(
        quantization=knobs.quantization, loaded_as=wp.quantization or p.weights_format,
        cpu_offload_gib=knobs.cpu_offload_gib, swap_space_gib=knobs.swap_space_gib,
        enforce_eager=knobs.enforce_eager,
        loaded_gib_per_card=round(wp.loaded_bytes_per_card / GIB, 3),
        offloaded_gib_per_card=round(wp.offload_bytes_per_card / GIB, 3),
        card_weights_gib=round(wp.card_weights_bytes / GIB, 3), card_weights_log_gib=None,
        host_offload_gib=round(wp.offload_bytes_per_card * cards / GIB, 3),
        host_swap_gib=round(knobs.swap_gib * p.tp, 3),
        host_available_gib=round(host.available_bytes / GIB, 3) if host else None,
        host_total_gib=round(host.total_bytes / GIB, 3) if host else None,
        host_provenance=host.provenance if host else None,
    )


def widen_hint(err: InfeasibleError, knobs: Knobs) -> None:
    """An infeasible length on a small card: also name the knobs that make room for KV."""
    more = [] if knobs.enforce_eager else ["--enforce-eager (no CUDA-graph pool on the card)"]
    more.append("a larger --cpu-offload-gb (weights to the host: slower decode)"
                if knobs.cpu_offload_gib else "--cpu-offload-gb N (weights to the host: slower "
                "decode)")
    if not knobs.quantization:
        more.append("--quantization bitsandbytes (4-bit weights)")
    err.hint = f"{err.hint or ''}; or make room on the card: {', '.join(more)}".lstrip("; ")


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


def _check(opts: RunOptions) -> None:
    v.int_range("--max-num-seqs", opts.max_num_seqs, 1, MAX_NUM_SEQS)
    if opts.model_use_gib is not None:
        raise BadInputError("--model-use-gb is vLLM-MindSpore r0.1's variable; a V1 engine "
                            "takes --kv-cache-memory-bytes, which pretuner derives",
                            hint="drop --model-use-gb")


def _batch(opts: RunOptions, engine: V1Engine, world_size: int,
           env: Mapping[str, str]) -> tuple[int, int, str | None]:
    """The run's max-num-seqs and max-num-batched-tokens: the user's, else the engine's
    defaults (proven and deployed explicitly), with the decision line saying whose."""
    seqs, batched = opts.max_num_seqs, opts.max_num_batched_tokens
    line = None
    if seqs is None or not batched:
        d = engine.batch_defaults(world_size, env)
        seqs, batched = seqs or d.max_num_seqs, batched or d.max_num_batched_tokens
        line = (f"the engine's defaults where not given: max-num-seqs {seqs}, "
                f"max-num-batched-tokens {batched} ({d.source}); proven and written into the "
                "startup files")
    v.int_range("--max-num-batched-tokens", opts.max_num_batched_tokens, seqs)
    return seqs, batched, line


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
    _check(opts)
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
    server_env = {**({"HF_HUB_OFFLINE": "1"} if local else {}),
                  **(compile_cache_env(os.environ, row.graph_cache)
                     if not choice.simulated and not opts.serve_cmd else {})}
    engine = V1Engine(row, choice.simulated, choice.version, sim_env, python=choice.python,
                      server_args=server_args, server_env=server_env,
                      mm_flags=vision.flags,
                      tuning_env=dict(row.dev_env) if vision.soak.on else {},
                      knobs=knobs, serve_cmd=tuple(shlex.split(opts.serve_cmd or "")))
    max_len, block = layout.max_model_len, layout.block_size
    p = decide_layout(layout)
    host = host_memory(engine.device_kind, {**os.environ, **sim_env}) if knobs.active else None
    host_line = check_host(p, knobs, host)
    seqs, batched, batch_line = _batch(opts, engine, p.tp * p.pp, {**os.environ, **sim_env})
    bpt = kv_bytes_per_token(spec, tp=p.tp, pp=p.pp, kv_dtype=opts.kv_cache_dtype)
    cfg = V1Config(model=spec, card_gib=card, bytes_per_token=bpt, util=opts.util,
                   max_model_len=max_len, max_num_seqs=seqs,
                   max_num_batched_tokens=batched,
                   block_size=block, tp=p.tp, pp=p.pp,
                   kv_cache_dtype=opts.kv_cache_dtype, max_launches=opts.max_launches,
                   validate=opts.validate, repeat_proof=opts.repeat_proof,
                   profile_prerun=row.profile_prerun or choice.simulated)
    model_arg = engine.model_arg(opts.model, spec)
    budget = engine.budget_bytes(card)
    reader = select_reader(engine.device_kind, {**os.environ, **sim_env}, p.tp * p.pp,
                           budget_mib=budget // MIB if budget is not None else None,
                           visible_var=row.visible_devices_var)
    ctx = launch_context(opts, engine, model_arg, spec, reader,
                         hooks=V1Hooks(bpt, vision.images, vision.soak))
    named = emulator().card_name(sim_env) if choice.simulated else None  # "emulated H200 141 GB"
    card_info = CardInfo(card, None, named or (
        "--card" if opts.card_gib is not None else "the device's size"))
    weights = weights_record(p, knobs, host)

    def start(execute: Executor, phase: Phase, on_decision: OnDecision) -> PinnedMethod:
        return PinnedMethod(cfg, execute, phase, on_decision, setup=setup, engine=engine,
                            weights_format=p.weights_format, weights=weights,
                            min_tokens_per_s=opts.min_tokens_per_s, host_line=host_line,
                            batch_line=batch_line)

    setup = Setup(choice, engine, model_arg, ctx, card_info, p.layout_reason, cfg, start,
                  vision)
    return setup


class PinnedMethod(V1Tuner):
    """The pinned-KV loop as the pipeline drives it."""

    name: MethodName = "v1-pinned-kv"
    then = ("read the engine's own profile and the device's peak, pin --kv-cache-memory-bytes "
            "below them by the measured margin, and validate: the worst request alone, "
            "concurrent max-length requests, then a burst of max-num-seqs short ones "
            "(launch 2).")

    def __init__(self, cfg: V1Config, execute: Executor, phase: Phase, on_decision: OnDecision,
                 *, setup: Setup[V1Config], engine: V1Engine, weights_format: str,
                 weights: V1Weights | None, min_tokens_per_s: float | None,
                 host_line: str | None, batch_line: str | None = None) -> None:
        super().__init__(cfg, execute, phase, on_decision)
        self.setup, self.engine, self.host_line, self.batch_line = (setup, engine, host_line,
                                                                    batch_line)
        # What the report says besides the common `RunMeta`: the weights' format, their plan
        # (predicted), --min-tokens-per-s asked, a vision-language model's images and soak.
        self.weights_format, self.weights = weights_format, weights
        self.min_tokens_per_s = min_tokens_per_s
        self.vision = None if setup.vision.images is None else setup.vision

    def begin(self) -> None:
        engine = self.engine
        self.phase("engine", self.setup.choice.reason)
        if self.setup.ctx.device_reader is None:
            self.phase("device", "no device memory reader here: the engine's own profiling "
                       "will be pinned, nothing measured beyond it")
        refuse_busy_devices(engine, self.setup.ctx.device_reader, self.cfg.util)
        self.decide("layout", self.setup.layout_reason, tp=self.cfg.tp, pp=self.cfg.pp)
        if self.batch_line:
            self.decide("batch", self.batch_line, max_num_seqs=self.cfg.max_num_seqs,
                        max_num_batched_tokens=self.cfg.max_num_batched_tokens)
        if engine.knobs.active:
            self.decide("weights", f"{engine.knobs.words()}: the same in every launch"
                        + (f"; {self.host_line}" if self.host_line else ""),
                        **engine.knobs.to_json())

    def run(self) -> V1Result:
        try:
            return super().run()
        except InfeasibleError as err:
            widen_hint(err, self.engine.knobs)
            raise

    def report_json(self, result: V1Result, meta: RunMeta) -> RunReport:
        return report_json(result, meta, self)

    def layout(self, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's layout; on a Ray cluster (`cluster`, the check's record) its nodes."""
        w, c = self.weights, self.cfg
        # A run that quantized its weights: the format they loaded as (bitsandbytes-nf4-dq).
        loaded = w.loaded_as if w and w.quantization else self.weights_format
        return {"model": c.model.name, "card_gib": c.card_gib, "tp": c.tp, "pp": c.pp,
                "nodes": len(cluster["nodes"]) if cluster else 1,
                "weights_format": loaded, "kv_bytes_per_token": c.bytes_per_token}
