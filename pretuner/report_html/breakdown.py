"""The memory of one card as parts that sum to the card: pure arithmetic on report.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB_MIB = 1024.0


@dataclass(frozen=True, slots=True)
class Segment:
    label: str
    mib: float
    provenance: str  # "derived", "measured (simulated)", "given", ...
    kind: str  # the CSS class: weights, headroom, rounding, kv, margin, free

    @property
    def gib(self) -> float:
        return self.mib / GIB_MIB


@dataclass(frozen=True, slots=True)
class Breakdown:
    """The parts of one card; `segments` sum to `total_mib` (the last one is the remainder,
    computed, never read)."""

    total_mib: float
    total_label: str
    segments: tuple[Segment, ...]
    overrun_mib: float = 0.0  # > 0 when the parts read exceed the card: the bar is clipped


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def with_remainder(total_mib: float, total_label: str, parts: list[Segment],
                   remainder_label: str, remainder_kind: str,
                   remainder_provenance: str = "derived: the card less the parts") -> Breakdown:
    """`parts` and what is left of the card, so the segments sum to the card exactly."""
    used = sum(p.mib for p in parts)
    left = total_mib - used
    overrun = max(0.0, -left)
    segments = [*parts, Segment(remainder_label, max(0.0, left), remainder_provenance,
                                remainder_kind)]
    return Breakdown(total_mib, total_label, tuple(segments), overrun)


def breakdown_r01(rep: dict[str, Any]) -> Breakdown | None:
    """r0.1: weights + activations, headroom, rounding and the KV cache fill card x util; the
    rest of the card is outside the pool. None when the run has no derivation (it failed)."""
    d = rep.get("derivation") or {}
    card = _num(rep.get("card_gib"))
    weights = _num(d.get("weights_act_gib"))
    kv = _num(rep.get("max_kv_gib"))
    if card is None or weights is None or kv is None:
        return None
    peak = (rep.get("provenance") or {}).get("actual_peak_mib")
    measured = f"derived from the {peak} peak" if peak else "derived from the peak"
    parts = [Segment("weights + activations", weights * GIB_MIB, measured, "weights")]
    headroom = _num(d.get("headroom_total_gib"))
    if headroom is not None:
        parts.append(Segment("headroom", headroom * GIB_MIB, "given + derived", "headroom"))
    rounding = _num(d.get("rounding_cost_gib"))
    if rounding is not None:
        parts.append(Segment("rounding to integer model-use", rounding * GIB_MIB, "derived",
                             "rounding"))
    parts.append(Segment("KV cache", kv * GIB_MIB, "derived", "kv"))
    util = _num(((rep.get("final") or {}).get("flags") or {}).get("gpu_memory_utilization"))
    outside = "outside the pool (card x (1 - util))" if util is not None else "free"
    return with_remainder(card * GIB_MIB, f"card {card:g} GiB ({card * GIB_MIB:,.0f} MiB)",
                          parts, outside, "free")


def breakdown_memory(rep: dict[str, Any]) -> Breakdown | None:
    """V1 with the final configuration's own memory (`memory` in report.json): its non-KV peak,
    the soak's growth and what is held back for more, the pinned KV; the rest is free."""
    m = rep.get("memory")
    if not isinstance(m, dict):
        return None
    total, non_kv, kv = (_num(m.get(k)) for k in ("device_total_mib", "non_kv_peak_mib",
                                                   "pinned_kv_mib"))
    if total is None or non_kv is None or kv is None:
        return None
    how = str(rep.get("provenance") or "measured")
    parts = [Segment("non-KV peak before the soak (weights, activations, graphs, encoder)",
                     non_kv, how, "weights")]
    growth, held = _num(m.get("soak_growth_mib")), _num(m.get("held_back_mib"))
    if growth:
        parts.append(Segment("growth under the soak", growth, how, "growth"))
    if held:
        parts.append(Segment("held back for more growth", held, f"derived from the {how} soak",
                             "margin"))
    parts.append(Segment("pinned KV cache", kv, "derived", "kv"))
    return with_remainder(total, f"device total {total:,.0f} MiB ({total / GIB_MIB:.2f} GiB), "
                          f"launch {m.get('launch')} at its worst moment", parts,
                          "free at the worst moment", "free")


def breakdown_v1(rep: dict[str, Any]) -> Breakdown | None:
    """V1: the non-KV peak, the pinned KV and the margin; the rest of the device (rounding the
    KV down to a MiB) is free. None when the run has no derivation (it failed). A run that
    recorded its final configuration's memory shows that instead (`breakdown_memory`)."""
    if (measured := breakdown_memory(rep)) is not None:
        return measured
    d = rep.get("derivation") or {}
    total = _num(d.get("device_total_mib"))
    non_kv = _num(d.get("non_kv_peak_mib"))
    kv_bytes = _num((rep.get("final") or {}).get("kv_cache_memory_bytes"))
    kv = kv_bytes / 2**20 if kv_bytes is not None else _num(d.get("pinned_kv_mib"))
    if total is None or non_kv is None or kv is None:
        return None
    how = str(rep.get("provenance") or "measured")
    parts = [
        Segment("non-KV peak (weights, activations, graphs)", non_kv, how, "weights"),
        Segment("pinned KV cache", kv, "derived", "kv"),
    ]
    margin = _num(d.get("margin_mib"))
    if margin is not None:
        parts.append(Segment("margin", margin, "given", "margin"))
    return with_remainder(total, f"device total {total:,.0f} MiB ({total / GIB_MIB:.2f} GiB)",
                          parts, "free (the KV rounded down)", "free")


def is_v1(rep: dict[str, Any]) -> bool:
    return str(rep.get("method") or "r0.1") != "r0.1"


def breakdown(rep: dict[str, Any]) -> Breakdown | None:
    return breakdown_v1(rep) if is_v1(rep) else breakdown_r01(rep)
