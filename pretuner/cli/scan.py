"""`pretuner scan`: show every memory line found in logs, per rank."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pretuner.cli.app import app
from pretuner.cli.render import emit, table, warn
from pretuner.errors import NothingFoundError

if TYPE_CHECKING:
    from pretuner.logscan import ScanResult


@app.command(
    "scan",
    short_help="List every memory line (pool dumps, OOMs, KV figures) in logs.",
    epilog="""\b
Examples:
  pretuner scan server.log
  pretuner scan runs/<run>/launch-1 --json""",
)
def scan_cmd(
    paths: list[Path] = typer.Argument(
        ..., metavar="LOG", help="Log files or folders (searched recursively)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Find pool dumps, OOM reports and engine KV figures in MindSpore / vLLM logs."""
    from pretuner.logscan import scan_paths  # numpy: not for `pretuner --help`

    result = scan_paths(paths)
    emit(as_json, result.to_json(), render(result))
    if as_json:  # the text says these in its TRUNCATED lines
        for cut in result.truncated:
            warn(cut.describe())
        if result.truncated_omitted:
            warn(f"{result.truncated_omitted:,} more truncated dump(s), not listed")
    for item in result.unreadable:
        warn(f"could not read {item.file}: {item.reason}")
    if not result.events:
        raise NothingFoundError(
            f"no memory line in {len(result.files)} file(s), {result.lines_scanned:,} lines",
            hint=(
                "run the server with GLOG_v=1 (the pool dump is an INFO line), stop it "
                "gracefully (a SIGKILLed server prints nothing at exit), and pass its stderr "
                "log or its GLOG_log_dir folder"
            ),
        )


def render(result: ScanResult) -> str:
    """The human-readable report."""
    out = [
        f"scanned {len(result.files)} file(s), {result.lines_scanned:,} lines, "
        f"{result.bytes_scanned / 2**20:,.1f} MiB"
    ]
    if result.ranks:
        rows = [[
            "-" if r.rank is None else r.rank,
            "-" if r.pid is None else r.pid,
            f"{r.actual_peak_mib:,}" if r.actual_peak_mib is not None
            else "unknown (cut)" if r.truncated_dumps else "-",
            "-" if r.peak_used_mib is None else f"{r.peak_used_mib:,.0f}",
            r.dumps if not r.truncated_dumps else f"{r.dumps} + {r.truncated_dumps} cut",
            r.oom_count,
            f"{r.file}:{r.line}",
        ] for r in result.ranks]
        headers = ["rank", "pid", "actual peak MiB", "peak used MiB", "dumps", "OOMs", "where"]
        out += ["", table(headers, rows)]
    worst = result.worst
    if worst is not None and worst.actual_peak_mib is not None:
        who = f"rank {worst.rank}" if worst.rank is not None else f"pid {worst.pid}"
        out.append(f"\nworst actual peak: {worst.actual_peak_mib:,} MiB ({who})")
        if result.truncated:
            out.append(
                f"  from the complete dumps only: {result.truncated_total:,} truncated, so the "
                "worst may be higher"
            )
    for cut in result.truncated:
        out.append(f"TRUNCATED: {cut.describe()}")
    if result.truncated_omitted:
        out.append(f"TRUNCATED: {result.truncated_omitted:,} more, not listed")
    figures = (
        ("card", result.card_mib, "{:,} MiB"),
        ("weights (engine)", result.weights_gib, "{:.2f} GiB"),
        ("available KV cache (engine)", result.available_kv_gib, "{:.2f} GiB"),
        ("KV cache size (engine)", result.kv_cache_tokens, "{:,} tokens"),
        ("maximum concurrency (engine)", result.max_concurrency, "{:.2f}x"),
        ("KV blocks (engine)", result.kv_blocks, "{:,}"),
    )
    out += [f"{name}: {unit.format(value)}" for name, value, unit in figures if value is not None]
    for o in result.oom:
        phase = "" if o.phase.value == "unknown" else f", {o.phase.value}"
        out.append(f"OOM ({o.kind.value}{phase}) at {o.file}:{o.line}: {o.event.message}")
    if result.oom_omitted:
        out.append(f"OOM: {result.oom_omitted:,} more report(s), not listed")
    return "\n".join(out)
