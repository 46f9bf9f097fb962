"""`pretuner analyze`: the documented pre-run method on logs a user already has (MindSpore r0.1
pool dumps), or a V1 engine log's KV budget."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pretuner import validate as v
from pretuner.cli.app import app
from pretuner.cli.render import echo_json
from pretuner.cli.vocab import PP_FLAGS, TP_FLAGS, UTIL_FLAGS, KvDtype, human_int, kv_dtype
from pretuner.files import write_atomic
from pretuner.method import DEFAULT_HEADROOM_GIB
from pretuner.units import GIB, MIB

if TYPE_CHECKING:
    from pretuner.analyze.r01 import AnalyzeResult
    from pretuner.analyze.v1_result import V1Analysis

# The analysis is imported where it runs: `pretuner --help` and a usage error answer without
# loading it (tests/test_cli_startup.py).

# Far above any device's memory (the largest accelerators hold under 300 GiB).
MAX_CARD_TOTAL_MIB = v.MAX_CARD_GIB * 1024


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
    logs: list[Path] = typer.Argument(
        ..., metavar="LOG", help="Log files, per-rank log folders, or .gz files (of one run)."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        metavar="MODEL",
        help="Registry name, alias, or local HF folder. Required for MindSpore r0.1 logs; for "
        "V1 logs it gives the exact KV bytes per token (else derived from the log).",
    ),
    memory_series: Path | None = typer.Option(
        None,
        "--memory-series",
        metavar="FILE",
        help="V1 logs: the device memory sampled during the run, as an NVML series "
        "(EPOCH_S<TAB>PHASE<TAB>USED_MIB rows) or repeated `nvidia-smi --query-gpu=index,"
        "memory.used,memory.total --format=csv,noheader,nounits` lines: its peak says what "
        "the card could hold.",
    ),
    card_total_mib: int | None = typer.Option(
        None,
        "--card-total-mib",
        metavar="MIB",
        help="V1 logs: the device total in MiB as NVML reports it (81559 on an H100 80GB; "
        "default: the nvidia-smi CSV's memory.total).",
    ),
    card: int | None = typer.Option(
        None, "--card", metavar="GIB", help="r0.1 logs: card GiB (default: from the log)."
    ),
    util: float | None = typer.Option(
        None,
        *UTIL_FLAGS,
        metavar="FRACTION",
        help="r0.1 logs: --gpu-memory-utilization of the pre-run (not given: 0.9, said as "
        "assumed).",
    ),
    model_use_gb: int | None = typer.Option(
        None,
        "--model-use-gb",
        metavar="GIB",
        help="r0.1 logs: vLLM_MODEL_MEMORY_USE_GB of the pre-run (not given: 50, said as assumed).",
    ),
    max_model_len: int | None = typer.Option(
        None,
        "--max-model-len",
        metavar="TOKENS",
        parser=human_int,
        help="r0.1 logs: the pre-run's max_model_len (not given: 16384, said as assumed; "
        "V1: read from the log).",
    ),
    tp: int | None = typer.Option(
        None,
        *TP_FLAGS,
        metavar="N",
        help="Tensor parallel size (default: ranks found; V1: the log's).",
    ),
    pp: int = typer.Option(
        1, *PP_FLAGS, metavar="N", help="Pipeline parallel size (V1 default: the log's)."
    ),
    kv_cache_dtype: KvDtype = typer.Option(
        KvDtype.AUTO, "--kv-cache-dtype", help="KV cache dtype (vLLM's names too)."
    ),
    block_size: int = typer.Option(
        16, "--block-size", metavar="TOKENS", help="KV block size in tokens."
    ),
    headroom_gb: float = typer.Option(
        DEFAULT_HEADROOM_GIB,
        "--headroom-gb",
        metavar="GIB",
        help="r0.1 logs: GiB added to weights+activations.",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        metavar="FILE",
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
    from pretuner.analyze.r01 import AnalyzeConfig, analyze_logs, assumed_line
    from pretuner.analyze.v1_result import V1Analysis
    from pretuner.envfile import env_file_text
    from pretuner.models import resolve

    if card is not None:
        v.int_range("--card", card, 1, v.MAX_CARD_GIB)
    if card_total_mib is not None:
        v.int_range("--card-total-mib", card_total_mib, 1, MAX_CARD_TOTAL_MIB)
    if tp is not None:
        v.int_range("--tp", tp, 1)
    v.int_range("--pp", pp, 1)
    if util is not None:
        v.finite("--util", util, example="0.9")
    v.non_negative("--headroom-gb", headroom_gb, example="1")
    v.choice("--block-size", block_size, v.BLOCK_SIZES)
    cfg = AnalyzeConfig(
        paths=tuple(logs),
        model=resolve(model) if model is not None else None,
        card_gib=card,
        util=util,
        model_use_gib=model_use_gb,
        max_model_len=max_model_len,
        tp=tp,
        pp=pp,
        kv_cache_dtype=kv_dtype(kv_cache_dtype),
        block_size=block_size,
        headroom_gib=headroom_gb,
        memory_series=memory_series,
        card_total_mib=card_total_mib,
    )
    result = analyze_logs(cfg)
    if isinstance(result, V1Analysis):
        _v1_output(result, logs, out, as_json)
        return
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
        said = assumed_line(result.assumed)
        if said is not None:
            typer.echo(f"pretuner: warning: {said}", err=True)
        return
    typer.echo(render_analysis(result))
    if out is not None:
        typer.echo(f"\nwrote {out}")


def render_analysis(r: AnalyzeResult) -> str:
    from pretuner.analyze.r01 import assumed_line, dumped_ranks
    from pretuner.derivation_text import derivation_lines

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
    said = assumed_line(r.assumed)
    if said is not None:
        lines += ["", f"warning: {said}"]
    return "\n".join(lines)


def _v1_output(result: V1Analysis, logs: list[Path], out: Path | None, as_json: bool) -> None:
    if out is not None:
        write_atomic(out, v1_flags_text(result, logs))
    if as_json:
        data = result.to_json()
        data["out"] = str(out) if out else None
        echo_json(data)
        return
    typer.echo(render_v1(result))
    if out is not None:
        typer.echo(f"\nwrote {out}")


def v1_flags_text(r: V1Analysis, logs: list[Path]) -> str:
    """The --out file of a V1 analysis: the flag to try, with where it comes from."""
    lines = [
        f"# pretuner analyze {shlex.join(str(p) for p in logs)} (V1 engine log)",
        f"# {r.outcome}",
    ]
    if r.suggestion is None:
        lines.append("# no --kv-cache-memory-bytes to suggest: see the warnings")
    else:
        s = r.suggestion
        lines += [
            f"# {s.basis}: {s.kv_bytes / GIB:.2f} GiB; a candidate until validated",
            f"# {r.next_step}",
            s.flag,
        ]
    lines += [f"# warning: {w}" for w in r.warnings]
    return "\n".join(lines) + "\n"


def render_v1(r: V1Analysis) -> str:
    """The V1 analysis as text: the log's figures with their provenance, then the arithmetic."""
    log = r.log
    rows: list[tuple[str, str]] = []
    if log.weights_gib is not None:
        rows.append(("weights", f"{log.weights_gib:.2f} GiB"))
    if log.kv_gib is not None and r.kv_mode is not None:
        kv = f"{log.kv_gib:.2f} GiB, {r.kv_mode}"
        if r.kv_mode == "pinned" and r.kv_in_log_bytes is not None:
            kv += f" (--kv-cache-memory-bytes {r.kv_in_log_bytes})"
        elif r.kv_mode == "profiled":
            kv += " (what profiling left under --gpu-memory-utilization)"
        rows.append(("KV cache", kv))
    if log.kv_tokens is not None:
        rows.append(("KV tokens", f"{log.kv_tokens:,}"))
    if log.max_concurrency is not None:
        at = f" at max_model_len {r.max_model_len:,}" if r.max_model_len else ""
        rows.append(("concurrency", f"{log.max_concurrency:.2f}x{at}"))
    if log.graphs_gib is not None:
        rows.append(("graph capture", f"{log.graphs_gib:.2f} GiB (after the KV allocation)"))
    if log.non_kv_gib is not None:
        rows.append(("non-KV (profiled)", f"{log.non_kv_gib:.2f} GiB"))
    if log.max_num_batched_tokens is not None:
        rows.append(("max_num_batched_tokens", f"{log.max_num_batched_tokens:,}"))
    if r.oom_phase is not None:
        size = (
            f"{log.oom_alloc_bytes / MIB:,.1f} MiB"
            if log.oom_alloc_bytes is not None
            else "size not printed"
        )
        rows.append(("out of memory", f"{size} at {r.oom_phase}: {log.oom_text}"))
    if log.estimated_max_len is not None:
        rows.append(("longest sequence", f"{log.estimated_max_len:,} tokens (estimated)"))
    lines = [
        f"V1 engine log: {', '.join(r.files)}",
        f"outcome: {r.outcome}",
        "",
        "what the log shows (measured from the log):",
    ]
    width = max((len(k) for k, _ in rows), default=0)
    lines += [f"  {k.ljust(width)}  {val}" for k, val in rows]
    if r.bytes_per_token is not None:
        lines.append(f"KV bytes/token: {r.bytes_per_token:,} B, {r.bytes_per_token_source}")
    if r.held_kv_bytes is not None:
        held = f"{r.held_kv_bytes / MIB:,.1f} MiB ({r.held_kv_bytes / GIB:.2f} GiB)"
        if r.held_kv_from_tokens and log.kv_tokens is not None and r.bytes_per_token:
            lines.append(
                f"KV held = {log.kv_tokens:,} tokens x {r.bytes_per_token:,} B = "
                f"{r.held_kv_bytes:,} B = {held}, derived"
            )
        else:
            lines.append(f"KV held: {held}, {r.held_kv_source}")
    if r.series is not None:
        phases = ", ".join(f"{k} {val:,}" for k, val in r.series.phase_peaks_mib.items())
        lines.append(
            f"device peak: {r.series.peak_mib:,} MiB over {r.series.samples:,} samples "
            f"(measured, {r.series.source} series {r.series.file})"
            + (f"; per phase, MiB: {phases}" if phases else "")
        )
    if r.total_mib is not None:
        lines.append(f"device total: {r.total_mib:,} MiB, {r.total_source}")
    lines.append("")
    if r.warnings:
        lines += [f"WARNING: {w}" for w in r.warnings] + [""]
    if r.budget is not None:
        lines.append("what the card could hold (from the measured device peak):")
        lines += [f"  {x}" for x in r.budget.lines()]
    elif r.back_off is not None:
        lines.append("what the next run can hold (back-off from the out-of-memory error):")
        lines += [f"  {x}" for x in r.back_off.lines()]
    elif r.suggestion is not None:
        lines.append("what the log proves (no device peak):")
    if r.suggestion is not None:
        lines += [f"  {x}" for x in r.suggestion.lines()]
    for n in r.notes:
        lines.append(f"note: {n}")
    if r.suggestion is not None:
        s = r.suggestion
        lines += ["", f"try:  {s.flag}  ({s.kv_bytes / GIB:.2f} GiB, {s.basis})"]
    lines.append(f"next: {r.next_step}")
    return "\n".join(lines)
