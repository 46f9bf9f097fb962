"""`pretuner analyze`: the documented pre-run method on logs a user already has (MindSpore r0.1
pool dumps), or a V1 engine log's KV budget."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

import pretuner.cli.options as o
from pretuner import validate as v
from pretuner.cli.app import app
from pretuner.cli.render import emit, warn
from pretuner.cli.vocab import PP_FLAGS, TP_FLAGS, UTIL_FLAGS, KvDtype, human_int, kv_dtype
from pretuner.files import write_atomic
from pretuner.method import DEFAULT_HEADROOM_GIB

# The analysis is imported where it runs: `pretuner --help` and a usage error answer without
# loading it (tests/test_cli_startup.py).


@app.command(
    "analyze",
    short_help="Derive the configuration from a pre-run's logs (no launch).",
    epilog="""\b
Examples:
  pretuner analyze server.log --model qwen3-8b --card 64 --util 0.9 --model-use-gb 50
  pretuner analyze glog_dir/ --model deepseek-v3 --json
  pretuner analyze vllm.log --memory-series nvml.tsv --card-total-mib 81559""",
)
def analyze_cmd(
    ctx: typer.Context,
    logs: list[Path] = typer.Argument(
        ..., metavar="LOG", help="Log files, per-rank log folders, or .gz files (of one run)."
    ),
    model: str | None = typer.Option(
        None, "--model", "-m", metavar="MODEL",
        help="Registry name, alias, or local HF folder. Required for MindSpore r0.1 logs; for "
        "V1 logs it gives the exact KV bytes per token (else derived from the log).",
    ),
    memory_series: Path | None = typer.Option(
        None, "--memory-series", metavar="FILE",
        help="V1 logs: the device memory sampled during the run, as an NVML series "
        "(EPOCH_S<TAB>PHASE<TAB>USED_MIB rows) or repeated `nvidia-smi --query-gpu=index,"
        "memory.used,memory.total --format=csv,noheader,nounits` lines: its peak says what "
        "the card could hold.",
    ),
    card_total_mib: int | None = typer.Option(
        None, "--card-total-mib", metavar="MIB",
        help="V1 logs: the device total in MiB as NVML reports it (81559 on an H100 80GB; "
        "default: the nvidia-smi CSV's memory.total).",
    ),
    card_gib: int | None = typer.Option(
        None, "--card", metavar="GIB", help="r0.1 logs: card GiB (default: from the log)."
    ),
    util: float | None = typer.Option(
        None, *UTIL_FLAGS, metavar="FRACTION",
        help="r0.1 logs: --gpu-memory-utilization of the pre-run (not given: 0.9, said as "
        "assumed).",
    ),
    model_use_gib: int | None = typer.Option(
        None, "--model-use-gb", metavar="GIB",
        help="r0.1 logs: vLLM_MODEL_MEMORY_USE_GB of the pre-run (not given: 50, said as assumed).",
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", metavar="TOKENS", parser=human_int,
        help="r0.1 logs: the pre-run's max_model_len (not given: 16384, said as assumed; V1: "
        "read from the log)."),
    tp: int | None = typer.Option(
        None, *TP_FLAGS, metavar="N",
        help="Tensor parallel size (default: ranks found; V1: the log's).",
    ),
    pp: int | None = typer.Option(
        None, *PP_FLAGS, metavar="N", help="Pipeline parallel size (default: 1; V1: the log's)."
    ),
    kv_cache_dtype: o.KvCacheDtype = KvDtype.AUTO,
    block_size: int = typer.Option(
        16, "--block-size", metavar="TOKENS", help="KV block size in tokens."
    ),
    headroom_gib: float = typer.Option(
        DEFAULT_HEADROOM_GIB, "--headroom-gb", metavar="GIB",
        help="r0.1 logs: GiB added to weights+activations.",
    ),
    out: Path | None = typer.Option(
        None, "--out", metavar="FILE",
        help="Write the env file (r0.1) or the --kv-cache-memory-bytes flag (V1) here "
        "(never overwrites).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Derive the memory configuration from a server's logs.

    A MindSpore r0.1 log (pool dumps): every rank's `actual peak used` and the documented
    pre-run method (vLLM-MindSpore's guide).
    A V1 engine log (vLLM >= 0.8 on CUDA/CPU, vllm-ascend, vLLM-MindSpore >= 0.3): what the run
    shows and the --kv-cache-memory-bytes to try; with --memory-series and the device total,
    what the card could hold.
    """
    from pretuner.analyze import AnalyzeConfig
    from pretuner.analyze.front import analyze_logs
    from pretuner.models import resolve

    v.layout(card_gib, util, tp, pp, block_size, headroom_gib)
    if card_total_mib is not None:
        v.int_range("--card-total-mib", card_total_mib, 1, v.MAX_CARD_GIB * 1024)
    result = analyze_logs(o.named(
        AnalyzeConfig, ctx.params, paths=tuple(logs), kv_cache_dtype=kv_dtype(kv_cache_dtype),
        model=resolve(model) if model is not None else None))
    if out is not None:
        write_atomic(out, result.out_text(f"pretuner analyze {shlex.join(str(p) for p in logs)}"))
    emit(as_json, {**result.to_json(), "out": str(out) if out else None}, result.text())
    if as_json:
        for warning in result.json_warnings():
            warn(warning)
    elif out is not None:
        typer.echo(f"\nwrote {out}")
