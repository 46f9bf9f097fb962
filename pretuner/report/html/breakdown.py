"""The memory of one card as parts that sum to the card: pure arithmetic on the run's record."""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.report.records import (
    AnyReport,
    PinnedDerivation,
    R01Derivation,
    RunReport,
    V1Memory,
)

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


def with_remainder(total_mib: float, total_label: str, parts: list[Segment],
                   remainder_label: str, remainder_kind: str) -> Breakdown:
    """`parts` and what is left of the card, so the segments sum to the card exactly."""
    left = total_mib - sum(p.mib for p in parts)
    rest = Segment(remainder_label, max(0.0, left), "derived: the card less the parts",
                   remainder_kind)
    return Breakdown(total_mib, total_label, (*parts, rest), max(0.0, -left))


def breakdown_r01(rep: RunReport, d: R01Derivation) -> Breakdown:
    """r0.1: weights + activations, headroom, rounding and the KV cache fill card x util; the
    rest of the card is outside the pool."""
    card = rep.card_gib
    parts = [Segment("weights + activations", d.weights_act_gib * GIB_MIB,
                     f"derived from the {rep.provenance} peak", "weights"),
             Segment("headroom", d.headroom_total_gib * GIB_MIB, "given + derived", "headroom"),
             Segment("rounding to integer model-use", d.rounding_cost_gib * GIB_MIB, "derived",
                     "rounding"),
             Segment("KV cache", rep.final.kv_gib * GIB_MIB, "derived", "kv")]
    return with_remainder(card * GIB_MIB, f"card {card:g} GiB ({card * GIB_MIB:,.0f} MiB)",
                          parts, "outside the pool (card x (1 - util))", "free")


def breakdown_memory(rep: RunReport, m: V1Memory) -> Breakdown:
    """V1 with the final configuration's own memory: its non-KV peak, the soak's growth and
    what is held back for more, the pinned KV; the rest is free."""
    how = rep.provenance
    parts = [Segment("non-KV peak before the soak (weights, activations, graphs, encoder)",
                     m.non_kv_peak_mib, how, "weights")]
    if m.soak_growth_mib:
        parts.append(Segment("growth under the soak", m.soak_growth_mib, how, "growth"))
    if m.held_back_mib:
        parts.append(Segment("held back for more growth", m.held_back_mib,
                             f"derived from the {how} soak", "margin"))
    parts.append(Segment("pinned KV cache", m.pinned_kv_mib, "derived", "kv"))
    total = m.device_total_mib
    return with_remainder(total, f"device total {total:,.0f} MiB ({total / GIB_MIB:.2f} GiB), "
                          f"launch {m.launch} at its worst moment", parts,
                          "free at the worst moment", "free")


def breakdown_v1(rep: RunReport, d: PinnedDerivation) -> Breakdown | None:
    """V1: the non-KV peak, the pinned KV and the margin; the rest of the device (rounding the
    KV down to a MiB) is free. None when no device was sampled. A run that recorded its final
    configuration's memory shows that instead (`breakdown_memory`)."""
    if d.memory is not None:
        return breakdown_memory(rep, d.memory)
    b = d.budget
    if b is None:
        return None
    kv = b.pinned_kv_mib if d.kv_cache_memory_bytes is None else d.kv_cache_memory_bytes / 2**20
    parts = [
        Segment("non-KV peak (weights, activations, graphs)", b.non_kv_peak_mib,
                rep.provenance, "weights"),
        Segment("pinned KV cache", kv, "derived", "kv"),
        Segment("margin", b.margin_mib, "given", "margin"),
    ]
    total = b.device_total_mib
    return with_remainder(total, f"device total {total:,.0f} MiB ({total / GIB_MIB:.2f} GiB)",
                          parts, "free (the KV rounded down)", "free")


def breakdown(rep: AnyReport) -> Breakdown | None:
    """The card's parts; None when the run has no derivation (it failed)."""
    if not isinstance(rep, RunReport):
        return None
    d = rep.derivation
    return breakdown_r01(rep, d) if isinstance(d, R01Derivation) else breakdown_v1(rep, d)
