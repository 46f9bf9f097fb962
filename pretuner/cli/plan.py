"""`pretuner plan`: predict the memory split without launching anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from pretuner.cli.app import app
from pretuner.cli.render import echo_json, table
from pretuner.cli.vocab import PP_FLAGS, TP_FLAGS, UTIL_FLAGS, KvDtype, human_int, kv_dtype
from pretuner.models.quant import METHODS
from pretuner.models.vision import parse_limit_mm_per_prompt
from pretuner.units import GIB

if TYPE_CHECKING:
    from pretuner.models.vision import VisionPlan
    from pretuner.plan.layout import PlanResult

# Only what the options' help and defaults name is imported here; the planner is imported
# where it runs, so `pretuner --help` answers at once (tests/test_cli_startup.py).


@app.command(
    "plan",
    short_help="Predict the layout run would launch: weights, KV cache, max-num-seqs (no launch).",
    epilog="""\b
Examples:
  pretuner plan --model deepseek-v3 --card 64
  pretuner plan --model qwen3-8b --card 24 --max-model-len 32K --kv-cache-dtype fp8 --json
  pretuner plan --model qwen3-vl-8b --engine vllm --card 64 --tp 2 --limit-mm-per-prompt image=2
  pretuner plan -m deepseek-r1-distill-llama-70b --card 32 --engine vllm --tp 1 --max-model-len 8K

\b
The flags it shares with `pretuner run` take run's defaults and checks: plan shows the layout
run would launch. Exit codes: 2 bad input, 4 no layout fits (plan says what would).""",
)
def plan_cmd(
    model: str = typer.Option(
        ..., "--model", "-m", metavar="MODEL", help="Registry name, alias, or local HF folder."
    ),
    card: int | None = typer.Option(
        None, "--card", metavar="GIB", help="Card GiB (default: as run, what the device reports)."
    ),
    util: float = typer.Option(
        0.9, *UTIL_FLAGS, metavar="FRACTION", help="--gpu-memory-utilization."
    ),
    max_model_len: int | None = typer.Option(
        None,
        "--max-model-len",
        metavar="TOKENS",
        parser=human_int,
        help="Tokens per request (32K, 32k...; default the engine's, as run).",
    ),
    tp: int | None = typer.Option(
        None, *TP_FLAGS, metavar="N", help="Tensor parallel size (default: chosen)."
    ),
    pp: int = typer.Option(1, *PP_FLAGS, metavar="N", help="Pipeline parallel size."),
    nodes: int | None = typer.Option(
        None, "--nodes", metavar="N", help="Nodes (default: from TP x PP)."
    ),
    cards_per_node: int = typer.Option(8, "--cards-per-node", metavar="N", help="Cards per node."),
    kv_cache_dtype: KvDtype = typer.Option(
        KvDtype.AUTO, "--kv-cache-dtype", help="KV cache dtype (vLLM's names too)."
    ),
    block_size: int | None = typer.Option(
        None, "--block-size", metavar="TOKENS",
        help="KV block size in tokens (default the engine's: 16 on r0.1 and vLLM, 128 on "
        "vllm-ascend and vLLM on CPU).",
    ),
    weights_format: str | None = typer.Option(
        None, "--weights-format", metavar="FORMAT", help="Checkpoint format, e.g. bf16, w8a8."
    ),
    headroom_gb: float | None = typer.Option(
        None, "--headroom-gb", metavar="GIB", help="GiB added to weights+activations (0.5)."
    ),
    kv_gib: float | None = typer.Option(
        None, "--kv-gib", metavar="GIB", help="Also say how many tokens fit in this many GiB."
    ),
    limit_mm_per_prompt: str | None = typer.Option(
        None,
        "--limit-mm-per-prompt",
        metavar="LIMITS",
        help="VL models (V1 engines): images per prompt, vLLM's forms image=2 or "
        "'{\"image\": 2}' (default vLLM's 999, capped by what fits in --max-model-len).",
    ),
    max_num_batched_tokens: int | None = typer.Option(
        None,
        "--max-num-batched-tokens",
        metavar="TOKENS",
        parser=human_int,
        help="VL models: sizes vLLM's encoder cache (default vLLM's, 8192).",
    ),
    mm_processor_cache_gb: float | None = typer.Option(
        None,
        "--mm-processor-cache-gb",
        metavar="GIB",
        help="VL models: vLLM's preprocessor cache, host memory per API server (default 4).",
    ),
    engine: str = typer.Option(
        "auto",
        "--engine",
        metavar="NAME",
        help="auto | vllm-mindspore-r01 | vllm | vllm-ascend | vllm-mindspore (0.3+) | vllm-cpu, "
        "as run picks it. When the weights fit no layout of these cards, a V1 engine's plan "
        "proposes quantization, then offload.",
    ),
    quantization: str | None = typer.Option(
        None,
        "--quantization",
        metavar="METHOD",
        help=f"V1 engines: vLLM's --quantization: {' | '.join(METHODS)} (bitsandbytes loads "
        "4-bit).",
    ),
    cpu_offload_gb: float = typer.Option(
        0.0, "--cpu-offload-gb", metavar="GIB", help="Weights per card kept in host memory."
    ),
    swap_space: float | None = typer.Option(
        None, "--swap-space", metavar="GIB", help="Host memory per card for preempted KV blocks."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Predict the layout `pretuner run` would launch, and its weights, activations, KV cache
    and max-num-seqs per card (no launch)."""
    import dataclasses

    from pretuner.devices.cpu import host_available_bytes
    from pretuner.errors import InfeasibleError
    from pretuner.models.vision import DEFAULT_MM_PROCESSOR_CACHE_GIB
    from pretuner.plan.propose import decide_layout, propose, proposes, render_proposal
    from pretuner.plan.weights import is_v1
    from pretuner.tune.entry import run_layout_options
    from pretuner.tune.options import RunOptions

    opts = RunOptions(
        model=model, engine=engine, card_gib=card, util=util, max_model_len=max_model_len,
        tp=tp, pp=pp, nodes=nodes, block_size=block_size, kv_cache_dtype=kv_dtype(kv_cache_dtype),
        weights_format=weights_format, headroom_gib=headroom_gb,
        max_num_batched_tokens=max_num_batched_tokens, limit_mm_per_prompt=limit_mm_per_prompt,
        mm_processor_cache_gb=mm_processor_cache_gb,
        quantization=quantization.strip().lower() if quantization else None,
        cpu_offload_gib=cpu_offload_gb, swap_space_gib=swap_space,
    )  # fmt: skip
    cfg = run_layout_options(opts)
    limits = parse_limit_mm_per_prompt(limit_mm_per_prompt) if limit_mm_per_prompt else {}
    cfg = dataclasses.replace(  # no image key: None, vLLM then allows 999
        cfg, kv_gib=kv_gib, image_limit=limits.get("image"),
        max_num_batched_tokens=max_num_batched_tokens, cards_per_node=cards_per_node,
        mm_processor_cache_gib=(DEFAULT_MM_PROCESSOR_CACHE_GIB if mm_processor_cache_gb is None
                                else mm_processor_cache_gb))
    if is_v1(cfg.engine) or cpu_offload_gb:
        cfg = dataclasses.replace(cfg, host_available_bytes=host_available_bytes())
    try:
        result = decide_layout(cfg)
    except InfeasibleError as err:  # say what would serve it: stdout, or the error's JSON
        if proposes(cfg):
            proposal, _ = propose(cfg)
            err.report = {"fits": False, "proposal": proposal.to_json()}
            if not as_json:
                typer.echo("\n".join(render_proposal(proposal)))
        raise
    if as_json:
        echo_json(result.to_json())
    else:
        typer.echo(render_plan(result))


def render_images(vp: VisionPlan) -> list[str]:
    """The "images" block of a vision-language model's plan."""
    side = vp.max_image_side_px
    fits = (
        f"{vp.images_per_prompt} fit{'s' if vp.images_per_prompt == 1 else ''} in "
        f"max_model_len {vp.max_model_len:,}: {vp.prompt_image_tokens:,} tokens "
        f"({vp.prompt_image_tokens / vp.max_model_len:.0%})"
    )
    lines = [
        "images (predicted, max-size images):",
        f"  tokens per image: {vp.tokens_per_image:,} tokens at {side} x {side} px",
        f"  images per prompt: limit {vp.image_limit} ({vp.image_limit_source}); {fits}",
    ]
    if vp.tokens_per_image > vp.max_model_len and vp.image_limit:
        lines.append(
            f"  note: one max-size image ({vp.tokens_per_image:,} tokens) exceeds max_model_len"
        )
    lines += [
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
    return lines


def render_plan(r: PlanResult) -> str:
    from pretuner.engines.mindspore_r01 import R01
    from pretuner.plan.weights import render_weights_plan
    from pretuner.presets.model import preset_line

    engine = (r.weights_plan.engine if r.weights_plan else None) or R01
    lines = [
        f"{r.model} on {r.card_gib} GiB cards, util {r.util}, {engine} (all figures predicted, "
        "no launch)",
        f"layout: TP{r.tp} x PP{r.pp} on {r.nodes} node(s) - {r.layout_reason}",
    ]
    for tp, why in r.rejected:
        lines.append(f"  TP{tp} rejected: {why}")
    for note in r.notes:
        lines.append(f"  note: {note}")
    lines += [
        f"weights ({r.weights_format}): {r.weights_bytes_per_card / GIB:.2f} GiB per card",
        f"KV cache: {r.kv_bytes_per_token:,} bytes per token per card, block {r.block_size}",
        "",
    ]
    # r0.1 is told an integer model-use GiB; a V1 engine's KV cache is pinned in bytes.
    r01 = r.requested.model_use_gib is not None
    rows = [
        (
            f"{lp.max_model_len:,}",
            f"{lp.activation_bytes / GIB:.2f}",
            *((lp.model_use_gib,) if r01 else ()),
            f"{lp.kv_bytes / GIB:.2f}",
            f"{lp.kv_tokens:,}",
            lp.max_num_seqs,
        )
        for lp in (r.requested, *r.ladder)
    ]
    head = ("max_model_len", "activation GiB", *(("model-use GiB",) if r01 else ()), "KV GiB",
            "KV tokens", "max-num-seqs")  # fmt: skip
    lines.append(table(head, rows))
    if not r.requested.fits:
        lines.append(
            f"\n{r.requested.max_model_len:,} tokens does not fit one sequence on this layout."
        )
    if r.weights_plan and r.weights_plan.active:
        req = r.requested
        lines += ["", *render_weights_plan(r.weights_plan, req.activation_bytes, req.kv_bytes)]
    if r.kv_query:
        lines.append(f"\n{r.kv_query[0]} GiB of KV cache holds {r.kv_query[1]:,} tokens (derived).")
    if r.vision:
        lines += ["", *render_images(r.vision)]
    lines.append(preset_line(r.model, r.card_gib, r.tp, r.requested.kv_tokens, "predicted"))
    lines.append("\nPredictions only: `pretuner run` measures them with a pre-run.")
    return "\n".join(lines)
