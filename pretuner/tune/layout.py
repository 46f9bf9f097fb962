"""The layout options `pretuner run` resolves for its flags, without starting a server: what
`pretuner plan` decides on. The same checks in the same order (the same exit-2 refusals), the
same card sizing and the engine's own defaults as the run's setup, so plan cannot decide apart.
"""

from __future__ import annotations

import os

from pretuner.devices.npu_smi import detect_card
from pretuner.engines.mindspore_r01 import BLOCK_SIZE
from pretuner.engines.registry import choose_engine
from pretuner.engines.vllm_v1 import ROWS, parse_server_args
from pretuner.errors import BadInputError
from pretuner.models import resolve
from pretuner.plan.layout import PlanConfig, layout_options, v1_layout_options
from pretuner.tune.options import RunOptions, v1_only_flags
from pretuner.tune.pinned.setup import vision_setup
from pretuner.tune.pinned.weights import knobs_of


def run_layout_options(opts: RunOptions) -> PlanConfig:
    """The layout options a run of `opts` decides on; bad input refused as `run` refuses it."""
    choice = choose_engine(opts.engine)
    opts.check()
    if choice.name in ROWS:
        knobs, _ = knobs_of(opts, parse_server_args(opts.server_args))
        spec = resolve(opts.model)
        vision_setup(opts, spec)  # a text model refuses the image options
        return v1_layout_options(opts, ROWS[choice.name], choice.simulated, spec, knobs)
    check_r01_flags(opts)
    spec = resolve(opts.model)
    engine = choice.r01()
    card = opts.card_gib
    if card is None:
        env = engine.card_env(None, opts.seed, os.environ,
                              weights_format=spec.weights_format(opts.weights_format).name,
                              nodes=1)
        card = detect_card(engine.smi_command(), "npu-smi", None,
                           {**os.environ, **env, **opts.sim_env}).card_gib
    given = opts.max_model_len
    return layout_options(
        opts, model=spec, card_gib=card,
        block_size=BLOCK_SIZE if opts.block_size is None else opts.block_size,
        max_model_len=engine.lengths.max_model_len if given is None else given,
    )  # fmt: skip


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
