"""SVG geometry for report.html, pure: the breakdown's stacked bar and each launch's memory
over time. The template only draws what is computed here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretuner.devices.series import LaunchMemory
from pretuner.report.html.breakdown import GIB_MIB, Breakdown

# The phases of a vision-language validation's soak (`pretuner.tune.pinned.soak`): tinted apart.
SOAK_PHASES = frozenset({"soak-1", "soak-2", "reset", "after-soak"})
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf")  # one per device, repeating past eight


@dataclass(frozen=True, slots=True)
class Rect:
    x: float
    width: float
    kind: str
    label: str  # shown beside the bar (and as the rect's tooltip)


@dataclass(frozen=True, slots=True)
class Bar:
    width: float
    rects: tuple[Rect, ...]


def bar(b: Breakdown, width: float = 1000.0) -> Bar:
    """The breakdown as one horizontal stacked bar `width` wide (the card)."""
    scale = width / b.total_mib if b.total_mib > 0 else 0.0
    rects: list[Rect] = []
    x = 0.0
    for s in b.segments:
        w = s.mib * scale
        rects.append(Rect(round(x, 2), round(w, 2), s.kind,
                          f"{s.label}: {s.gib:.2f} GiB ({s.provenance})"))
        x += w
    return Bar(width, tuple(rects))


def nice_step(span: float, ticks: int = 6) -> float:
    """A 1, 2 or 5 times a power of ten step that cuts `span` into about `ticks` parts."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1.0, 2.0, 5.0, 10.0) if m * mag >= raw)


@dataclass(frozen=True, slots=True)
class Tick:
    pos: float
    label: str


@dataclass(frozen=True, slots=True)
class Line:
    points: str  # "x,y x,y ..." for a polyline
    colour: str
    label: str


@dataclass(frozen=True, slots=True)
class Band:
    x: float
    width: float
    label: str
    shade: bool  # alternate phases are shaded
    soak: bool = False  # a soak phase: tinted
    peak_mib: int = 0  # the most any device held in it


@dataclass(frozen=True, slots=True)
class Cap:
    y: float
    label: str
    kind: str  # "card" or "util"


@dataclass(frozen=True, slots=True)
class Chart:
    n: int
    width: float
    height: float
    left: float
    top: float
    plot_w: float
    plot_h: float
    lines: tuple[Line, ...]
    bands: tuple[Band, ...]
    caps: tuple[Cap, ...]
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    peak_label: str


def chart(mem: LaunchMemory, caps_mib: list[tuple[float, str, str]], width: float = 1000.0,
          height: float = 300.0) -> Chart | None:
    """Memory over time of one launch: a line per device, the phases as bands, the caps
    (`(MiB, label, kind)`) as dashed lines. None when the launch has no rows."""
    if not mem.rows:
        return None
    left, right, top, bottom = 70.0, 20.0, 24.0, 44.0
    plot_w, plot_h = width - left - right, height - top - bottom
    t_end = max(r.t_s for r in mem.rows) or 1.0
    y_max_mib = max([r.used_mib for r in mem.rows] + [c[0] for c in caps_mib]) * 1.04 or 1.0

    def x_of(t: float) -> float:
        return round(left + plot_w * t / t_end, 2)

    def y_of(mib: float) -> float:
        return round(top + plot_h * (1 - mib / y_max_mib), 2)

    devices = sorted({r.device for r in mem.rows})
    lines = tuple(
        Line(" ".join(f"{x_of(r.t_s)},{y_of(r.used_mib)}" for r in mem.rows if r.device == dev),
             COLOURS[i % len(COLOURS)], f"device {dev}")
        for i, dev in enumerate(devices)
    )
    bands: list[Band] = []
    starts: list[tuple[float, str]] = []  # (t, phase) where each phase run begins
    for r in sorted(mem.rows, key=lambda r: r.t_s):
        if not starts or starts[-1][1] != r.phase:
            starts.append((r.t_s, r.phase))
    for i, (t, name) in enumerate(starts):
        t_next = starts[i + 1][0] if i + 1 < len(starts) else t_end
        held = max(r.used_mib for r in mem.rows if r.phase == name and t <= r.t_s <= t_next)
        bands.append(Band(x_of(t), round(x_of(t_next) - x_of(t), 2), name, i % 2 == 0,
                          name in SOAK_PHASES, held))
    step_t = nice_step(t_end)
    x_ticks = tuple(Tick(x_of(k * step_t), f"{k * step_t:g}")
                    for k in range(int(t_end / step_t) + 1))
    y_max_gib = y_max_mib / GIB_MIB
    step_g = nice_step(y_max_gib, 5)
    y_ticks = tuple(Tick(y_of(k * step_g * GIB_MIB), f"{k * step_g:g}")
                    for k in range(int(y_max_gib / step_g) + 1))
    top_band = max(bands, key=lambda b: b.peak_mib)  # the first to reach the peak
    peak = top_band.peak_mib
    return Chart(
        mem.n, width, height, left, top, plot_w, plot_h, lines, tuple(bands),
        tuple(Cap(y_of(mib), label, kind) for mib, label, kind in caps_mib),
        x_ticks, y_ticks,
        f"peak {peak:,} MiB ({peak / GIB_MIB:.2f} GiB) of the series, set in phase "
        f"{top_band.label}, {len(devices)} device(s), read by {mem.reader or 'an unknown reader'}",
    )
