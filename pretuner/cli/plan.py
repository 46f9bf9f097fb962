"""`pretuner plan`: predict the memory split without launching anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

import pretuner.cli.options as o
from pretuner.cli.app import app
from pretuner.cli.render import emit, table
from pretuner.cli.vocab import KvDtype
from pretuner.models.vision import parse_limit_mm_per_prompt
from pretuner.units import GIB

if TYPE_CHECKING:
    from pretuner.models.vision import VisionPlan
    from pretuner.plan.layout import PlanResult

# Only what the options' help and defaults name is imported here; the planner is imported
# where it runs, so `pretuner --help` answers at once (tests/test_cli_startup.py).


@app.command(
    "plan", cls=o.PanelCommand,
    short_help="Predict the layout run would launch: weights, KV cache, max-num-seqs (no launch).",
    epilog="""\b
Examples:
  pretuner plan --model deepseek-v3 --card 64
  pretuner plan --model qwen3-8b --card 24 --max-model-len 32K --kv-cache-dtype fp8 --json
  pretuner plan --model qwen3-vl-8b --engine vllm --card 64 --tp 2 --limit-mm-per-prompt image=2
  pretuner plan -m deepseek-r1-distill-llama-70b --card 32 --engine vllm --tp 1 --max-model-len 8K

\b
The flags it shares with `pretuner run` take run's defaults and checks: plan shows the layout
run would launch. Exit codes: 2 bad input, 4 no layout fits (plan says what would: on a V1
engine, quantization, then offload).""",
)
def plan_cmd(
    ctx: typer.Context,
    model: o.RequiredModel,
    card_gib: o.Card = None,
    util: o.Util = 0.9,
    max_model_len: o.MaxModelLen = None,
    tp: o.Tp = None,
    pp: o.Pp = None,
    nodes: o.Nodes = None,
    cards_per_node: o.CardsPerNode = 8,
    kv_cache_dtype: o.KvCacheDtype = KvDtype.AUTO,
    block_size: o.BlockSize = None,
    weights_format: o.WeightsFormat = None,
    headroom_gib: float | None = typer.Option(None, "--headroom-gb", metavar="GIB",
                                             rich_help_panel=o.ADVANCED,
                                             help="GiB added to weights+activations (0.5)."),
    kv_gib: float | None = typer.Option(None, "--kv-gib", metavar="GIB",
                                        rich_help_panel=o.OUTPUTS,
                                        help="Also say how many tokens fit in this many GiB."),
    limit_mm_per_prompt: o.LimitMmPerPrompt = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    mm_processor_cache_gb: o.MmProcessorCacheGb = None,
    engine: o.Engine = "auto",
    emulate: o.Emulate = False,
    quantization: o.Quantization = None,
    cpu_offload_gib: o.CpuOffloadGb = 0.0,
    swap_space_gib: o.SwapSpace = None,
    as_json: bool = typer.Option(False, "--json", rich_help_panel=o.OUTPUTS,
                                 help="Print one JSON object."),
) -> None:
    """Predict the layout `pretuner run` would launch, and its weights, activations, KV cache
    and max-num-seqs per card (no launch)."""
    import dataclasses

    from pretuner.devices.cpu import meminfo_bytes
    from pretuner.errors import InfeasibleError
    from pretuner.plan.propose import decide_layout, propose, proposes, render_proposal
    from pretuner.tune.entry import run_layout_options

    cfg = run_layout_options(o.run_options(ctx.params))
    limits = parse_limit_mm_per_prompt(limit_mm_per_prompt) if limit_mm_per_prompt else {}
    cfg = dataclasses.replace(  # no image key: None, vLLM then allows 999
        cfg, kv_gib=kv_gib, image_limit=limits.get("image"),
        max_num_batched_tokens=max_num_batched_tokens, cluster=True,  # a prediction
        host_available_bytes=(meminfo_bytes("MemAvailable")
                              if cfg.engine_class.takes_weights_flags or cpu_offload_gib
                                                              else None),
        mm_processor_cache_gib=(cfg.mm_processor_cache_gib if mm_processor_cache_gb is None
                                else mm_processor_cache_gb))  # fmt: skip
    try:
        result = decide_layout(cfg)
    except InfeasibleError as err:  # say what would serve it: stdout, or the error's JSON
        if proposes(cfg):
            proposal = propose(cfg)
            err.report = {"fits": False, "proposal": proposal.to_json()}
            if not as_json:
                typer.echo("\n".join(render_proposal(proposal)))
        raise
    emit(as_json, result.to_json(), render_plan(result, model))


def render_images(vp: VisionPlan) -> list[str]:
    """The "images" block of a vision-language model's plan."""
    side = vp.max_image_side_px
    fits = (f"{vp.images_per_prompt} fit{'s' if vp.images_per_prompt == 1 else ''} in "
            f"max_model_len {vp.max_model_len:,}: {vp.prompt_image_tokens:,} tokens "
            f"({vp.prompt_image_tokens / vp.max_model_len:.0%})")
    lines = [
        "images (predicted, max-size images):",
        f"  tokens per image: {vp.tokens_per_image:,} tokens at {side} x {side} px",
        f"  images per prompt: limit {vp.image_limit} ({vp.image_limit_source}); {fits}",
    ]
    if vp.tokens_per_image > vp.max_model_len and vp.image_limit:
        lines.append(f"  note: one max-size image ({vp.tokens_per_image:,} tokens) exceeds "
                     "max_model_len")
    return [
        *lines,
        f"  encoder cache budget: {vp.encoder_cache_tokens:,} tokens = max(max-num-batched-tokens "
        f"{vp.max_num_batched_tokens:,}, one image) = {vp.encoder_cache_bytes / GIB:.2f} GiB "
        f"per card; profiled with {vp.profiled_images} image(s)",
        f"  vision weights: {vp.weights_bytes_per_card / GIB:.2f} GiB per card "
        f"({vp.vision_params:,} params, linear layers split by TP; inside the weights above)",
        f"  encoder activation: {vp.activation_bytes / GIB:.2f} GiB per card "
        f"({vp.profiled_images} image(s), estimate)",
        f"  image share: {vp.card_bytes / GIB:.2f} GiB = {vp.image_share:.1%} of card*util "
        f"{vp.budget_bytes / GIB:.2f} GiB",
        f"  processor cache: {vp.mm_processor_cache_gib:g} GiB of host memory per API server "
        "(not card memory)",
    ]


def render_plan(r: PlanResult, given: str | None = None) -> str:
    from pretuner.engines.mindspore_r01 import R01
    from pretuner.engines.vllm_v1 import card_unit
    from pretuner.plan.weights import render_weights_plan
    from pretuner.presets.model import preset_line

    engine = (r.weights_plan.engine if r.weights_plan else None) or R01
    lines = [
        f"{r.model} on {r.card_gib} {card_unit(engine)} cards, util {r.util}, {engine} (all "
        "figures predicted, no launch)",
        f"layout: TP{r.tp} x PP{r.pp} on {r.nodes} node(s) - {r.layout_reason}",
    ]
    lines += [f"  TP{tp}{f' x PP{pp}' if pp > 1 else ''} rejected: {why}"
              for tp, pp, why in r.rejected]
    lines += [f"  note: {note}" for note in r.notes]
    lines += [
        f"weights ({r.weights_format}): {r.weights_bytes_per_card / GIB:.2f} GiB per card",
        f"KV cache: {r.kv_bytes_per_token:,} bytes per token per card, block {r.block_size}",
        "",
    ]
    # r0.1 is told an integer model-use GiB; a V1 engine's KV cache is pinned in bytes.
    r01 = r.requested.model_use_gib is not None
    rows = [(f"{lp.max_model_len:,}", f"{lp.activation_bytes / GIB:.2f}",
             *((lp.model_use_gib,) if r01 else ()), f"{lp.kv_bytes / GIB:.2f}",
             f"{lp.kv_tokens:,}", lp.max_num_seqs) for lp in (r.requested, *r.ladder)]
    head = ("max_model_len", "activation GiB", *(("model-use GiB",) if r01 else ()), "KV GiB",
            "KV tokens", "max-num-seqs")  # fmt: skip
    lines.append(table(head, rows))
    if not r.requested.fits:
        lines.append(f"\n{r.requested.max_model_len:,} tokens does not fit one sequence on "
                     "this layout.")
    if r.weights_plan and r.weights_plan.active:
        req = r.requested
        lines += ["", *render_weights_plan(r.weights_plan, req.activation_bytes, req.kv_bytes)]
    if r.kv_query:
        lines.append(f"\n{r.kv_query[0]} GiB of KV cache holds {r.kv_query[1]:,} tokens (derived).")
    if r.vision:
        lines += ["", *render_images(r.vision)]
    lines.append(preset_line(r.model, r.card_gib, r.tp, r.requested.kv_tokens, "predicted",
                             engine, given))
    lines.append("\nPredictions only: `pretuner run` measures them with a pre-run.")
    return "\n".join(lines)
