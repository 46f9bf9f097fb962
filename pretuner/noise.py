"""How much headroom a proven configuration keeps for boot-to-boot noise. Pure.

The same configuration does not peak at the same MiB on every boot: on a real H200 (vLLM
0.24.0, tests/fixtures/real/vllm-0.24-h200-burst) two boots peaked 26 MiB apart under the proof
load and 500 MiB apart under a 1,024-wide short burst. One proof measures one boot, so the
headroom it keeps is a floor: the largest spread any repeated proof has shown, on every engine
(no r0.1 run has been repeated on a real card; the V1 figure is the largest seen), but never
more than max(256 MiB, 1 % of the card) unless this run's own boots measured more
(`--repeat-proof N`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

SPREAD_SEEN_MIB = 500  # the real H200's burst, tests/fixtures/real/vllm-0.24-h200-burst
CAP_FLOOR_MIB = 256
CAP_SHARE = 0.01  # of the device total


def floor_mib(total_mib: int, spread_mib: int = 0) -> int:
    """The least headroom (device total - proven peak) a proven configuration keeps: the
    documented floor, capped at max(256 MiB, 1 % of the card), or the measured spread if more."""
    cap = max(CAP_FLOOR_MIB, math.ceil(total_mib * CAP_SHARE))
    return max(min(SPREAD_SEEN_MIB, cap), spread_mib)


def spread_mib(peaks_mib: Iterable[int]) -> int:
    """The boot-to-boot spread of one configuration's proof peaks (max - min, MiB)."""
    peaks = list(peaks_mib)
    return max(peaks) - min(peaks) if peaks else 0


def short_mib(total_mib: int, peak_mib: int, spread: int = 0) -> int:
    """How far the kept headroom falls below what it must keep (0: it keeps enough)."""
    return max(0, floor_mib(total_mib, spread) - (total_mib - peak_mib))


def floor_words(total_mib: int, spread: int = 0) -> str:
    """Where the floor comes from, as a decision and `explain` say it."""
    need = floor_mib(total_mib, spread)
    if spread and need == spread:
        return f"{need:,} MiB (the boot-to-boot spread this run measured)"
    return (f"{need:,} MiB (the largest boot-to-boot spread seen, {SPREAD_SEEN_MIB} MiB on a real "
            f"H200, at most max({CAP_FLOOR_MIB} MiB, 1 % of {total_mib:,} MiB))")
