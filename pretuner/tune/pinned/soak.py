"""What a validation's soak says about memory that grows after load (pure).

The validation of a vision-language model samples each part as its own phase (see
`pretuner.engines.v1_images`): "worst", "images" and "burst" (the worst cases, before the soak),
"soak-1" and "soak-2" (the mixed load in two halves), "reset" (after /reset_mm_cache) and
"after-soak" (the worst-case burst again, on top of what the soak left). From their last and
peak samples:

    growth after load   = last sample of soak-2 - last sample before the soak
    growth after reset  = last sample after the reset - last sample before the soak
    second half's growth = last of soak-2 - last of soak-1: memory still growing at the end

The peak from the soak on (the burst after it included) is the worst case measured with the
soak's growth in it. On top of it, what a longer run may still add is held back: memory that
grows with distinct images saturates (caches fill, torch's blocks stop being new), so each
doubling of the traffic adds at most what the last one did; the second half is the soak's last
doubling, and `HOLD_DOUBLINGS` more of it are kept free: room for a run 4 times as long as the
soak. A soak that has settled holds nothing back.

The soak's growth rate (MiB per hour) is the least-squares slope of the worst device's samples
over both halves: every sample counts, so one noisy read moves it little (max - min over the
time would take the noisiest pair). The headroom left after the soak (device total - its last
level) lasts `headroom / rate` hours at that rate. Growth saturates, so a short soak's rate is
the fastest the memory grows, not its pace next week: under `TELL_MIN_S` or `TELL_MIN_SAMPLES`
it is an upper bound (and the time a lower bound); under `RATE_MIN_SAMPLES`, not measurable.
A slope that adds under one MiB over the whole soak (the readers' unit) is no growth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.v1_images import SOAK_PHASES

HOLD_DOUBLINGS = 2
# Every phase from the soak on: what the soak left is in their samples.
AFTER_PHASES = (*SOAK_PHASES, "reset", "after-soak", "stop")
RATE_MIN_SAMPLES = 3  # fewer soak samples: no slope worth a number
TELL_MIN_S = 600.0  # a soak shorter than 10 minutes: its rate is an upper bound
TELL_MIN_SAMPLES = 30  # fewer samples: likewise


@dataclass(frozen=True, slots=True)
class SoakFigures:
    """Device MiB (the worst device), as the sampler saw them in one launch."""

    before_mib: int  # last sample before the soak (the short burst's, else the image burst's)
    half_mib: int  # last sample of the soak's first half
    after_mib: int  # last sample of the soak's second half
    after_reset_mib: int | None  # last sample after /reset_mm_cache (None: no reset done)
    peak_before_mib: int  # the launch's peak before the soak (start-up and the worst case)
    peak_after_mib: int  # its peak from the soak on (the burst again after it included)
    requests: int
    reset_status: int | None

    @property
    def growth_mib(self) -> int:
        return self.after_mib - self.before_mib

    @property
    def second_half_mib(self) -> int:
        """What the soak's second half still added (never negative)."""
        return max(0, self.after_mib - self.half_mib)

    @property
    def held_back_mib(self) -> int:
        """Kept free for more growth: the second half's, HOLD_DOUBLINGS times."""
        return HOLD_DOUBLINGS * self.second_half_mib

    @property
    def reset_gave_back_mib(self) -> int | None:
        if self.after_reset_mib is None:
            return None
        return self.after_mib - self.after_reset_mib

    @property
    def settled(self) -> bool:
        """Whether the growth slowed: the second half added at most a quarter of it."""
        return 4 * self.second_half_mib <= max(0, self.growth_mib)

    @property
    def peak_growth_mib(self) -> int:
        """How much higher the launch peaked from the soak on than before it (>= 0)."""
        return max(0, self.peak_after_mib - self.peak_before_mib)


def soak_figures(o: LaunchOutcome) -> SoakFigures | None:
    """The soak's figures of a launch; None when it ran no soak (or nothing was sampled)."""
    last, peaks = o.device_last_mib, o.device_peaks_mib
    if not all(p in last for p in (*SOAK_PHASES, "images")):
        return None
    before = [v for p, v in peaks.items() if p not in AFTER_PHASES]
    after = [v for p, v in peaks.items() if p in AFTER_PHASES]
    return SoakFigures(
        before_mib=last.get("burst", last["images"]), half_mib=last["soak-1"],
        after_mib=last["soak-2"],
        after_reset_mib=last.get("reset") if o.reset_status == 200 else None,
        peak_before_mib=max(before),
        peak_after_mib=max(after), requests=o.soak_requests, reset_status=o.reset_status,
    )


@dataclass(frozen=True, slots=True)
class SoakRate:
    """The soak's growth rate and how long the headroom lasts at it (derived)."""

    rate_mib_per_h: float | None  # None: not measurable
    bound: str  # "fit", "upper bound" (too short to tell) or "not measurable"
    span_s: float  # the first to the last soak sample
    samples: int
    headroom_mib: int  # device total - the soak's last level

    @property
    def exhaustion_h(self) -> float | None:
        """Hours until the headroom is used up at the rate; None: it never is (no growth)."""
        if self.rate_mib_per_h is None or self.rate_mib_per_h <= 0:
            return None
        return max(0, self.headroom_mib) / self.rate_mib_per_h


def soak_rate(points: Sequence[tuple[float, int]], headroom_mib: int) -> SoakRate:
    """The rate of the soak's (seconds, worst device MiB) samples, oldest first."""
    span = points[-1][0] - points[0][0] if points else 0.0
    if len(points) < RATE_MIN_SAMPLES or span <= 0:
        return SoakRate(None, "not measurable", span, len(points), headroom_mib)
    t, used = np.array(points, dtype=float).T
    slope = float(np.polyfit(t - t[0], used, 1)[0])  # MiB per second
    if abs(slope) * span < 1:  # under a MiB over the whole soak: below what the reader tells
        slope = 0.0
    tells = span >= TELL_MIN_S and len(points) >= TELL_MIN_SAMPLES
    return SoakRate(slope * 3600, "fit" if tells else "upper bound", span,
                    len(points), headroom_mib)
