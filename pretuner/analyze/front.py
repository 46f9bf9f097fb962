"""The one entry of `analyze`: read the logs, and give them to the method they belong to."""

from __future__ import annotations

from pathlib import Path

from pretuner.analyze import AnalyzeConfig
from pretuner.analyze.r01 import R01Analysis, analyze_r01, dumped_ranks
from pretuner.analyze.v1 import V1Analysis, analyze_v1, read_series_file
from pretuner.errors import BadInputError
from pretuner.logscan import scan_paths


def analyze_logs(cfg: AnalyzeConfig) -> R01Analysis | V1Analysis:
    """A V1 engine's log (its KV lines and no MindSpore pool dump) gets `analyze_v1`, any other
    the r0.1 method (which says what is missing)."""
    series = read_series_file(cfg.memory_series) if cfg.memory_series is not None else None
    scan = scan_paths(cfg.paths)
    if dumped_ranks(scan) or not scan.v1.is_v1:
        return analyze_r01(cfg, scan)
    # One V1 server writes one log: files that each show an engine are runs of their own, and
    # the KV of one with the OOM of another would be a run that never was.
    runs = [f for f in scan.files if scan_paths([Path(f)]).v1.is_v1] if len(scan.files) > 1 else []
    if len(runs) > 1:
        raise BadInputError(
            f"the logs hold {len(runs)} runs of a V1 engine ({', '.join(runs)}): analyze "
            "reads one run at a time, never several merged",
            hint=f"pass one run's log, e.g. `pretuner analyze {runs[0]}`",
        )
    return analyze_v1(cfg, scan.v1, scan.files, series)
