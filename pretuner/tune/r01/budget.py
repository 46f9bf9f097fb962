"""How much of a card the tuned configuration may spend: reserves, headroom and the final util.

Pure. Every margin scales with what was measured, so that a 24 GB card loses as small a share
of its KV cache as a 64 GB one:
- the reserve kept below the card's free memory is what the device reader saw allocated outside
  the pool after MindSpore read the free memory (HCCL, rts), plus the hard margin; without a
  device reading it scales with the card (more on larger, busier cards);
- the base headroom on top of the measured weights+activations is a floor plus a share of the
  measured activations (what varies from one prefill to the next scales with them) plus the
  spread between the ranks' peaks (a rank that was not the worst in the pre-run may be under
  load); the per-sequence headroom (`pretuner.method.per_sequence_bytes`) comes on top.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pretuner.units import GIB, MIB

# The pool cap never comes closer than this to the card's free memory, per GiB of card: 8 MiB
# on a 64 GB card, 3 MiB on a 24 GB one (MindSpore accepts a pool up to the free memory), plus
# how far the free memory's readings moved between launches.
HARD_MARGIN_SHARE = 1 / 8192


def hard_margin_gib(card_gib: int, spread_mib: int = 0) -> float:
    return card_gib * HARD_MARGIN_SHARE + spread_mib / 1024
# Reserve below the free memory, per GiB of card: 0.25 GiB on a 64 GB card when the engine's
# init line measured the free memory (CANN already counted), 1 GiB when only npu-smi was read.
RESERVE_SHARE_MEASURED = 0.25 / 64
RESERVE_SHARE_DEVICE_TOOL = 1.0 / 64
BASE_HEADROOM_FLOOR_BYTES = 64 * MIB
BASE_HEADROOM_ACTIVATION_SHARE = 0.02


def reserve_gib(
    card_gib: int,
    *,
    measured_by_engine: bool, given: float | None, outside_mib: int | None = None,
    spread_mib: int = 0,
) -> float:
    """GiB kept free below the card's free memory when choosing the final util: `--reserve-gb`;
    else what was measured outside the pool (`outside_pool_mib`) plus the hard margin, when the
    free memory and the outside were both measured; else a share of the card."""
    if given is not None:
        return given
    if measured_by_engine and outside_mib is not None:
        return hard_margin_gib(card_gib, spread_mib) + outside_mib * MIB / GIB
    share = RESERVE_SHARE_MEASURED if measured_by_engine else RESERVE_SHARE_DEVICE_TOOL
    return max(hard_margin_gib(card_gib, spread_mib), card_gib * share)


def outside_pool_mib(
    device_peak_mib: int, device_total_mib: int, init_free_mib: int, pool_cap_mib: float
) -> int:
    """MiB a launch's device held beyond what was in use when MindSpore read the free memory
    (`total - free`) and its pool (MindSpore takes the whole cap at init): allocations of other
    components after that reading, which the final util must leave room for."""
    return max(0, math.ceil(device_peak_mib - (device_total_mib - init_free_mib) - pool_cap_mib))


def rank_spread_bytes(rank_peaks_mib: Mapping[str, int]) -> int:
    peaks = list(rank_peaks_mib.values())
    return (max(peaks) - min(peaks)) * MIB if len(peaks) > 1 else 0


def base_headroom_bytes(
    wa_bytes: int, weights_bytes: int, rank_peaks_mib: Mapping[str, int], given_gib: float | None
) -> int:
    """Headroom before the per-sequence part: `--headroom-gb`, or scaled to the measurement."""
    if given_gib is not None:
        return int(given_gib * GIB)
    activation = max(0, wa_bytes - weights_bytes)
    return (
        BASE_HEADROOM_FLOOR_BYTES
        + int(BASE_HEADROOM_ACTIVATION_SHARE * activation)
        + rank_spread_bytes(rank_peaks_mib)
    )


def floor_to(value: float, digits: int) -> float:
    scale = 10.0**digits
    return float(math.floor(value * scale + 1e-9)) / scale


UTIL_DIGITS = 4  # 0.0001 of a 64 GB card is 6.5 MiB


@dataclass(frozen=True, slots=True)
class FreeMemory:
    """The card's free memory as last measured, and by what."""

    mib: int
    source: str  # e.g. "MindSpore init line (measured)"
    measured_by_engine: bool
    spread_mib: int = 0  # how far the engine's readings moved between launches


def pool_util(
    card_gib: int, free: FreeMemory, reserve: float, rounding_gib: float = 0.0,
    outside_gib: float = 0.0,
) -> float:
    """The util whose pool leaves `reserve` GiB of the free memory unused, raised by the
    integer rounding of the model-use budget (which the pool holds but nothing uses), never
    closer than the hard margin, and what was measured outside the pool, to the free memory
    (MindSpore takes its whole pool at start: only a reserve that is a guess can lend)."""
    free_gib = free.mib * MIB / GIB
    util = floor_to((free_gib - reserve) / card_gib, UTIL_DIGITS)
    if rounding_gib > 0:
        recovered = floor_to((free_gib - reserve + rounding_gib) / card_gib, UTIL_DIGITS)
        margin = hard_margin_gib(card_gib, free.spread_mib) + outside_gib
        ceiling = floor_to((free_gib - margin) / card_gib, UTIL_DIGITS)
        util = max(util, min(recovered, ceiling))
    return min(1.0, util)


def max_pool_util(card_gib: int, free: FreeMemory) -> float:
    """The largest util a launch may use: the free memory less the hard margin."""
    margin = hard_margin_gib(card_gib, free.spread_mib)
    return min(1.0, floor_to((free.mib * MIB / GIB - margin) / card_gib, UTIL_DIGITS))
