"""The r0.1 method's `Setup` (the card as npu-smi sizes it, the layout, the emulated card's
environment, the launch context) and its `Tuner`, as the pipeline in `pretuner.tune.entry` runs
it."""

from __future__ import annotations

import os
import shlex
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pretuner.devices import select_reader
from pretuner.devices.npu_smi import CardInfo, detect_card
from pretuner.engines.base import LaunchSettings
from pretuner.engines.mindspore_r01 import BLOCK_SIZE, R01Engine, graph_cache_env
from pretuner.engines.outcome import Executor
from pretuner.engines.registry import EngineChoice
from pretuner.errors import BadInputError
from pretuner.launch.process import check_server_installed
from pretuner.method import check_launch_settings
from pretuner.models import builtin_specs, resolve
from pretuner.plan.layout import PlanConfig
from pretuner.report.records import Method as MethodName
from pretuner.report.records import RunReport
from pretuner.tune.execute import Phase
from pretuner.tune.r01.config import (
    TuneConfig,
    TuneResult,
    layout_of,
    plan_for,
    pool_on_demand,
    prerun_util,
)
from pretuner.tune.r01.prerun import PrerunSearch
from pretuner.tune.r01.validation import Validation
from pretuner.tune.report import RunMeta, plan_layout, report_json
from pretuner.tune.setup import OnDecision, Setup, launch_context

if TYPE_CHECKING:
    from pretuner.tune.options import RunOptions

NO_READER = "no device memory reader here: measuring from the logs only"


def r01_config(opts: RunOptions, choice: EngineChoice, card: CardInfo | None = None
               ) -> TuneConfig:
    """The r0.1 method's configuration for `opts`, bad input refused (exit 2): what `run`
    tunes and `plan` decides the layout of."""
    engine = choice.r01()
    opts.check()
    check_r01_flags(opts)
    spec = resolve(opts.model)
    engine.check_model(spec, opts.tp, opts.pp or 1,
                       [s.name for s in builtin_specs() if s.eager_attention])
    lengths = engine.lengths
    max_len = lengths.max_model_len if opts.max_model_len is None else opts.max_model_len
    min_len = (
        min(lengths.min_model_len, max_len) if opts.min_model_len is None else opts.min_model_len
    )
    if min_len > max_len:  # each is at least 1 (RunOptions.check)
        raise BadInputError(
            f"--min-model-len {min_len} must be between 1 and --max-model-len {max_len}",
            hint=f"e.g. --min-model-len {max(1, max_len // 4)}")
    if card is None:
        source = "emulated npu-smi" if engine.simulated else "npu-smi"
        env = card_env(opts, engine, spec.weights_format(opts.weights_format).name, 1)
        card = detect_card(engine.smi_command(), source, opts.card_gib, {**os.environ, **env})
    cfg = TuneConfig(
        model=spec, card=card, util=opts.util, max_model_len=max_len, min_model_len=min_len,
        tp=1 if engine.device_kind == "cpu" else opts.tp, pp=opts.pp, nodes=opts.nodes,
        cards_per_node=opts.cards_per_node,
        block_size=BLOCK_SIZE if opts.block_size is None else opts.block_size,
        kv_cache_dtype=opts.kv_cache_dtype, weights_format=opts.weights_format,
        headroom_gib=opts.headroom_gib, reserve_gib=opts.reserve_gib,
        max_launches=opts.max_launches, validate=opts.validate, model_use_gib=opts.model_use_gib,
        repeat_proof=opts.repeat_proof,
        provenance="simulated" if engine.simulated else "measured",
    )
    if opts.model_use_gib is not None:
        check_launch_settings(card.card_gib, prerun_util(cfg), opts.model_use_gib)
    return cfg


def card_env(opts: RunOptions, engine: R01Engine, weights_format: str, nodes: int
             ) -> dict[str, str]:
    """The environment the card is read and served with (the emulated card's, and --sim-env)."""
    env = engine.card_env(opts.card_gib, opts.seed, os.environ, weights_format=weights_format,
                          nodes=nodes)
    return {**env, **opts.sim_env}


def r01_setup(opts: RunOptions, choice: EngineChoice, card: CardInfo | None = None
              ) -> Setup[TuneConfig]:
    cfg = r01_config(opts, choice, card)
    engine, spec = choice.r01(), cfg.model
    p = plan_for(cfg)
    extra_env = card_env(opts, engine, p.weights_format, p.nodes)
    if not choice.simulated and not opts.serve_cmd:  # one graph cache for every launch
        extra_env |= graph_cache_env(os.environ)
    cfg = replace(cfg, pool_on_demand=pool_on_demand({**os.environ, **extra_env}))
    engine = replace(engine, serve_cmd=tuple(shlex.split(opts.serve_cmd or "")), nodes=p.nodes,
                     launch_env=extra_env)
    model_arg = engine.model_arg(opts.model, spec)
    if not engine.serve_cmd:
        check_server_installed(engine.serve_argv(model_arg))
    reader = select_reader(engine.device_kind, {**os.environ, **extra_env}, p.tp * p.pp)
    ctx = launch_context(opts, engine, model_arg, spec, reader,
                         decode_tokens=engine.lengths.decode_tokens)

    def start(execute: Executor, phase: Phase, on_decision: OnDecision) -> Tuner:
        return Tuner(cfg, execute, phase, on_decision, setup=setup)

    setup = Setup(choice, engine, model_arg, ctx, cfg.card, p.layout_reason, cfg, start)
    return setup


def r01_layout_options(opts: RunOptions, choice: EngineChoice) -> PlanConfig:
    """What `pretuner plan` decides on for an r0.1 run of `opts`; a given --card is not read."""
    card = None if opts.card_gib is None else CardInfo(opts.card_gib, None, "given")
    return layout_of(r01_config(opts, choice, card))


def check_r01_flags(opts: RunOptions) -> None:
    """Refuse what only a V1 engine takes: the r0.1 method builds its own command and sends
    no images (exit 2)."""
    if opts.server_args:
        raise BadInputError("--server-arg (and a --config key pretuner does not read) passes "
                            "flags to a V1 engine's server; the r0.1 "
                            "method builds its own command",
                            hint="name a V1 engine (--engine vllm|vllm-cpu|...), or give the "
                            "whole command with --serve-cmd")
    image_flags = [flag for flag, value in (
        ("--limit-mm-per-prompt", opts.limit_mm_per_prompt),
        ("--mm-processor-cache-gb", opts.mm_processor_cache_gb),
        ("--soak", opts.soak or None),  # `--soak 0` is no soak: what r0.1 does anyway
        ("--soak-minutes", opts.soak_minutes)) if value is not None]
    if image_flags:
        raise BadInputError(f"{', '.join(image_flags)}: the r0.1 method sends no images "
                            "(vLLM-MindSpore r0.1, on vLLM 0.6.6, serves no Qwen3-VL)",
                            hint="name a V1 engine (--engine vllm|vllm-ascend|vllm-mindspore) "
                            f"for a vision-language model, or drop {' '.join(image_flags)}")
    v1_only = [flag for flag, on in (*opts.knobs_given().items(),
                                     ("--min-tokens-per-s", opts.min_tokens_per_s is not None))
               if on]
    if v1_only:
        raise BadInputError(f"{v1_only[0]} (given, or a --config key) is a V1 engine's "
                            "flag; the r0.1 method builds its own command",
                            hint="name a V1 engine (--engine vllm|...)")


class Tuner(PrerunSearch, Validation):
    """The r0.1 pre-run method: plan the layout, pre-run (max-num-seqs 1, one max-length
    request that must really run) until the longest length that fits at the memory the final
    configuration will have is known (`prerun`), derive at the final util (`core`), and prove it
    under full load (`validation`). Never report an unproven configuration."""

    name: MethodName = "r0.1"
    then = ("read every rank's `actual peak used` after a graceful stop, derive, and validate "
            "with max-num-seqs concurrent max-length requests, then a burst of as many short "
            "ones (launch 2).")

    def __init__(self, cfg: TuneConfig, execute: Executor, phase: Phase,
                 on_decision: OnDecision = None, *, setup: Setup[TuneConfig] | None = None
                 ) -> None:
        super().__init__(cfg, execute, phase, on_decision)
        self.setup = setup  # the pipeline's; None where a test drives the loop alone

    def begin(self) -> None:
        if self.setup is not None and self.setup.ctx.device_reader is None:
            self.phase("device", NO_READER)

    def first_launch(self) -> LaunchSettings:
        return self.prerun_settings(prerun_util(self.cfg), self.cfg.max_model_len)

    def report_json(self, result: TuneResult, meta: RunMeta) -> RunReport:
        engine = self.setup.engine if self.setup is not None else None
        assert isinstance(engine, R01Engine)  # noqa: S101 - only the pipeline writes a report
        return report_json(result, meta, engine)

    def layout(self) -> dict[str, Any]:
        return plan_layout(self.plan)

    def run(self) -> TuneResult:
        cfg = self.cfg
        self.decide(
            "layout", self.plan.layout_reason, tp=self.plan.tp, pp=self.plan.pp,
            nodes=self.plan.nodes,
        )
        for note in self.plan.notes:
            self.decide("layout note", note)
        self.check_start()  # a busy card ends the run here, before any util is derived
        util = prerun_util(cfg)
        if util < cfg.util:
            self.decide(
                "lower pre-run util",
                f"the card has {cfg.card.free_mib:,} MiB free ({cfg.card.source}); "
                f"util {cfg.util} would ask more",
                util=util,
            )
        best = self.search(util)
        derivation, source = self.derive(best)
        if not cfg.validate:
            self.decide("skip validation", "--no-validate: the configuration is NOT proven")
            return self.result(derivation, False, source, best, None)
        r = self.repeat(self.validate(best, derivation, source))
        return replace(r, outcomes=tuple(self.outcomes), decisions=tuple(self.decisions))


