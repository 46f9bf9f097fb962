"""The one entry of `analyze`: read the logs once, and give them to the method they belong to."""

from __future__ import annotations

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
    if not dumped_ranks(scan) and scan.v1.is_v1:
        return analyze_v1(cfg, scan.v1, scan.files)
    return analyze_r01(cfg, scan)
