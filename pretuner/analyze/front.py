"""The one entry of `analyze`: read the logs once, and give them to the method they belong to."""

from __future__ import annotations

from pathlib import Path

from pretuner.analyze import Analysis, AnalyzeConfig
from pretuner.analyze.r01 import analyze_r01, dumped_ranks
from pretuner.analyze.v1 import SERIES_HINT, analyze_v1
from pretuner.errors import BadInputError
from pretuner.logscan import scan_paths


def analyze_logs(cfg: AnalyzeConfig) -> Analysis:
    """A V1 engine's log (its KV lines and no MindSpore pool dump) gets `analyze_v1`, any other
    the r0.1 method (which says what is missing)."""
    scan = scan_paths(cfg.paths)
    if cfg.memory_series is not None and not cfg.memory_series.is_file():
        raise BadInputError(f"--memory-series {str(cfg.memory_series)!r} is not a file",
                            hint=SERIES_HINT)
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
    return analyze_v1(cfg, scan.v1, scan.files)
