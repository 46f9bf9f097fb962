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
"""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.v1_images import SOAK_PHASES

HOLD_DOUBLINGS = 2
# Every phase from the soak on: what the soak left is in their samples.
AFTER_PHASES = (*SOAK_PHASES, "reset", "after-soak", "stop")


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
