"""`analyze`: logs a user already has -> what the run shows and the configuration to try.

What both methods take and give: `r01` (MindSpore pool dumps: the documented pre-run method)
and `v1` (a V1 engine's KV lines: the `--kv-cache-memory-bytes` to try); `front.analyze_logs`
picks one (its own module, so that the methods import these without a cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretuner.method import DEFAULT_HEADROOM_GIB
from pretuner.models.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class AnalyzeConfig:
    """What the user says about the run the logs come from; None: not given."""

    paths: tuple[Path, ...]
    model: ModelSpec | None  # the r0.1 method needs it; a V1 log can derive bytes/token
    tp: int | None = None  # default: the ranks found (r0.1), the log's (V1)
    pp: int | None = None  # default: the log's (V1), else 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # The r0.1 pre-run's card and settings: a log does not say them; None: the card size the
    # log printed, the method's defaults said as assumed (`r01.ASSUMED_UTIL`...).
    card_gib: int | None = None
    util: float | None = None
    model_use_gib: int | None = None
    max_model_len: int | None = None
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    memory_series: Path | None = None  # V1: an NVML series or nvidia-smi CSV of the run
    card_total_mib: int | None = None  # V1: the device total (default: the nvidia-smi CSV's)


def pick(obj: object, *names: str) -> dict[str, Any]:
    """`{name: obj.name}` for the names given, in their order (the JSON of a record's figures)."""
    return {name: getattr(obj, name) for name in names}
