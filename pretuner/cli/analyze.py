"""`pretuner analyze`: the documented pre-run method on logs a user already has."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from pretuner import validate as v
from pretuner.analyze import AnalyzeConfig, AnalyzeResult, analyze, dumped_ranks
from pretuner.cli.app import app
from pretuner.cli.render import echo_json
from pretuner.derivation_text import derivation_lines
from pretuner.envfile import env_file_text
from pretuner.files import write_atomic
from pretuner.method import DEFAULT_HEADROOM_GIB
from pretuner.models import resolve


@app.command("analyze")
def analyze_cmd(
    logs: list[Path] = typer.Argument(..., help="Log files, per-rank log folders, or .gz files."),
    model: str = typer.Option(
        ..., "--model", "-m", help="Registry name, alias, or local HF folder."
    ),
    card: int | None = typer.Option(None, "--card", help="Card GiB (default: from the log)."),
    util: float = typer.Option(0.9, "--util", help="--gpu-memory-utilization of the pre-run."),
    model_use_gb: int = typer.Option(
        50, "--model-use-gb", help="vLLM_MODEL_MEMORY_USE_GB of the pre-run."
    ),
    max_model_len: int = typer.Option(
        16384, "--max-model-len", help="The pre-run's max_model_len."
    ),
    tp: int | None = typer.Option(
        None, "--tp", help="Tensor parallel size (default: ranks found)."
    ),
    pp: int = typer.Option(1, "--pp", help="Pipeline parallel size."),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype", help="auto|bf16|fp16|int8|fp8|int8-mla."
    ),
    block_size: int = typer.Option(16, "--block-size", help="KV block size in tokens."),
    headroom_gb: float = typer.Option(
        DEFAULT_HEADROOM_GIB, "--headroom-gb", help="GiB added to weights+activations."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Write the env/flags file here (never overwrites)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Find every rank's `actual peak used` and derive the configuration (seed 003 method)."""
    if card is not None:
        v.int_range("--card", card, 1, v.MAX_CARD_GIB)
    v.finite("--util", util, example="0.9")
    v.non_negative("--headroom-gb", headroom_gb, example="1")
    v.choice("--block-size", block_size, v.BLOCK_SIZES)
    cfg = AnalyzeConfig(
        paths=tuple(logs),
        model=resolve(model),
        card_gib=card,
        util=util,
        model_use_gib=model_use_gb,
        max_model_len=max_model_len,
        tp=tp,
        pp=pp,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        headroom_gib=headroom_gb,
    )
    result = analyze(cfg)
    if out is not None:
        header = [
            f"pretuner analyze {shlex.join(str(p) for p in logs)}",
            f"model {result.model}, card {result.card_gib} GiB, TP{result.tp}; worst-rank actual "
            f"peak {result.derivation.actual_peak_bytes // 2**20:,} MiB (measured)",
            *(f"warning: {cut.describe()}" for cut in result.scan.truncated),
        ]
        write_atomic(out, env_file_text(result.derivation.final, header))
    if as_json:
        data = result.to_json()
        data["out"] = str(out) if out else None
        echo_json(data)
        for cut in result.scan.truncated:
            typer.echo(f"pretuner: warning: {cut.describe()}", err=True)
        return
    typer.echo(render_analysis(result))
    if out is not None:
        typer.echo(f"\nwrote {out}")


def render_analysis(r: AnalyzeResult) -> str:
    worst = r.worst
    lines = [f"{r.model}, TP{r.tp} ({r.tp_source}), {r.kv_bytes_per_token:,} B/token KV per card"]
    lines.append("actual peak used per rank (measured):")
    for rank in dumped_ranks(r.scan):
        who = f"rank {rank.rank}" if rank.rank is not None else f"pid {rank.pid}"
        mark = "  <- worst" if rank is worst else ""
        if rank.truncated_dumps:
            mark += f"  ({rank.truncated_dumps} truncated dump(s))"
        peak = "unknown" if rank.actual_peak_mib is None else f"{rank.actual_peak_mib:,} MiB"
        lines.append(f"  {who}: {peak}  ({rank.file}:{rank.line}){mark}")
    for cut in r.scan.truncated:
        lines.append(f"warning: {cut.describe()}")
    if r.scan.truncated_omitted:
        lines.append(f"warning: {r.scan.truncated_omitted:,} more truncated dump(s), not listed")
    if r.scan.truncated:
        lines.append(
            "warning: the worst peak above comes from the complete dumps only and may be too "
            "low; for a sure figure, pre-run again and stop the server gracefully"
        )
    lines.append("")
    lines += derivation_lines(r.derivation, card_source=r.card_source)
    return "\n".join(lines)
