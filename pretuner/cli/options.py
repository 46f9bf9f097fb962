"""The options `run`, `plan` and `analyze` share, each written once with one help text.

A command declares `card: Card = None`; its own default goes after the `=`. Only typer and the
small modules the help texts name load here (tests/test_cli_startup.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer import _click
from typer.core import TyperCommand

from pretuner.cli.vocab import PP_FLAGS, TP_FLAGS, UTIL_FLAGS, KvDtype, human_int, kv_dtype
from pretuner.models.quant import METHODS

if TYPE_CHECKING:
    from pretuner.tune.options import RunOptions

# The panels `run --help` and `plan --help` group their options into, in this order.
MODEL_CARD, LENGTHS, ENGINE, PROOF, OUTPUTS, ADVANCED = PANELS = (
    "Model and card", "Lengths and batching", "Engine and where it lives", "Proof", "Outputs",
    "Advanced",
)


class PanelCommand(TyperCommand):
    """A command whose --help lists its options under their `rich_help_panel` titles."""

    # Typer draws panels only with rich, which --help must not load (tests/test_cli_startup.py).
    def format_options(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {title: [] for title in PANELS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                title = getattr(param, "rich_help_panel", None) or "Options"
                panels.setdefault(title, []).append(record)
        for title, records in panels.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


MODEL = typer.Option("--model", "-m", metavar="MODEL", rich_help_panel=MODEL_CARD,
                     help="Registry name, alias, or model path the server loads.")
Model = Annotated[str | None, MODEL]
RequiredModel = Annotated[str, MODEL]
Card = Annotated[int | None, typer.Option(
    "--card", metavar="GIB", rich_help_panel=MODEL_CARD,
    help="Card GiB, a V1 engine's device GB (default: what the device tool reports; emulated: "
    "64; V1 80, an H100; 40, 48, 94, 96, 141, 180: A100, L40S, H100 NVL, H20, H200, B200). "
    "vllm-cpu: the memory budget every server process runs under (default 6).",
)]
Engine = Annotated[str, typer.Option(
    "--engine", metavar="NAME", rich_help_panel=ENGINE,
    help="auto | vllm-mindspore-r01 | sim (its emulated card) | mindspore-cpu (real "
    "MindSpore on CPU) | vllm | vllm-ascend | vllm-mindspore (0.3+) | vllm-cpu. A V1 engine "
    "(vllm*) gets its KV cache pinned with --kv-cache-memory-bytes. A named engine not found "
    "is exit 2; only auto falls back to the emulated card, and says so.",
)]
Emulate = Annotated[bool, typer.Option(
    "--emulate", rich_help_panel=ENGINE,
    help="The emulated engine of that name (simulated figures): --engine vllm --emulate is "
    "the emulated vLLM server on an emulated CUDA card.",
)]
MaxModelLen = Annotated[int | None, typer.Option(
    "--max-model-len", metavar="TOKENS", parser=human_int, rich_help_panel=LENGTHS,
    help="Longest request to support (32K, 32k...; default the engine's: 16384, 4096 on "
    "vllm-cpu, 1024 on mindspore-cpu).",
)]
Util = Annotated[float, typer.Option(
    *UTIL_FLAGS, metavar="FRACTION", rich_help_panel=ADVANCED,
    help="Pre-run --gpu-memory-utilization (the method's 0.9).",
)]
Tp = Annotated[int | None, typer.Option(
    *TP_FLAGS, metavar="N", rich_help_panel=MODEL_CARD,
    help="Tensor parallel size (default: chosen by plan).",
)]
Pp = Annotated[int | None, typer.Option(
    *PP_FLAGS, metavar="N", rich_help_panel=MODEL_CARD,
    help="Pipeline parallel size (default: chosen by plan; V1 engines past one node: TP within "
    "a node, PP across nodes).",
)]
Nodes = Annotated[int | None, typer.Option(
    "--nodes", metavar="N", rich_help_panel=MODEL_CARD, help="Nodes (default: from the layout)."
)]
CardsPerNode = Annotated[int, typer.Option(
    "--cards-per-node", metavar="N", rich_help_panel=MODEL_CARD,
    help="Cards per node: the most a layout places on one node (8).",
)]
BlockSize = Annotated[int | None, typer.Option(
    "--block-size", metavar="TOKENS", rich_help_panel=LENGTHS,
    help="KV block size in tokens (default the engine's: 16 on r0.1 and vLLM, 128 on "
    "vllm-ascend and vLLM on CPU).",
)]
KvCacheDtype = Annotated[KvDtype, typer.Option(
    "--kv-cache-dtype", rich_help_panel=MODEL_CARD, help="KV cache dtype (vLLM's names too)."
)]
WeightsFormat = Annotated[str | None, typer.Option(
    "--weights-format", metavar="FORMAT", rich_help_panel=MODEL_CARD,
    help="Checkpoint format (bf16, w8a8...).",
)]
MaxNumBatchedTokens = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", metavar="TOKENS", parser=human_int, rich_help_panel=LENGTHS,
    help="V1 engines: production's prefill step budget (default: the engine's, 8192 on "
    "H100/H200-class GPUs, else 2048); "
    "for VL models it sizes the encoder cache.",
)]
LimitMmPerPrompt = Annotated[str | None, typer.Option(
    "--limit-mm-per-prompt", metavar="LIMITS", rich_help_panel=LENGTHS,
    help="VL models (V1 engines): vLLM's images per prompt, image=2 or '{\"image\": 2}' "
    "(default vLLM's 999, capped by what fits); the worst case carries that many.",
)]
MmProcessorCacheGb = Annotated[float | None, typer.Option(
    "--mm-processor-cache-gb", metavar="GIB", rich_help_panel=ADVANCED,
    help="VL models (V1 engines): vLLM's processor cache, host memory per API server "
    "(default 4); launched and kept.",
)]
Quantization = Annotated[str | None, typer.Option(
    "--quantization", metavar="METHOD", rich_help_panel=MODEL_CARD,
    help=f"V1 engines: vLLM's --quantization, {' | '.join(METHODS)} (bitsandbytes quantizes "
    "a 16-bit checkpoint to 4 bit as it loads).",
)]
CpuOffloadGb = Annotated[float, typer.Option(
    "--cpu-offload-gb", metavar="GIB", rich_help_panel=MODEL_CARD,
    help="V1 engines: weights per card kept in host memory and streamed to the card on "
    "every forward pass (fits a bigger model, decodes slower).",
)]
SwapSpace = Annotated[float | None, typer.Option(
    "--swap-space", metavar="GIB", rich_help_panel=ENGINE,
    help="V1 engines: host memory per card for preempted sequences' KV (default the "
    "engine's, 4); checked against the host.",
)]


def named(cls: Any, params: dict[str, Any], **values: Any) -> Any:
    """A `cls` (a dataclass) of a command's parameters, each named as its field; `values`
    over them."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in params.items() if k in names}, **values})


def run_options(params: dict[str, Any], **values: Any) -> RunOptions:
    """The `RunOptions` of `run`'s or `plan`'s parameters (`named`): the KV dtype in
    pretuner's spelling, --quantization in lower case."""
    from pretuner.tune.options import RunOptions

    quantization = params.get("quantization")
    run: RunOptions = named(
        RunOptions, params, kv_cache_dtype=kv_dtype(params["kv_cache_dtype"]),
        quantization=quantization.strip().lower() if quantization else None, **values)
    return run
