"""Where the next pre-run goes: weights+activations against length, from measured launches.

Pure. Every pre-run that ran measures weights+activations (WA) at its length; every pre-run
that ran out of memory proves a lower bound on WA at its length. `WaModel` fits WA(length)
through those figures and the measured weights, and `edge` finds the longest length the final
configuration could hold: the integer model-use budget ceil(WA + headroom) beside the KV cache
one max-length sequence needs (with the engine's block watermark), within the largest pool
the card's free memory allows.

The fit is a line: through the two longest measured lengths when there are two, else through
the weights at length 0 and the one measured length (the workspace then counts as slope, which
overestimates longer lengths; with chunked prefill only part of it grows with the length).
Lower bounds steepen it where they must. Attention can grow
faster than linearly, so whatever the fit adds beyond the longest measured length is inflated
by `EXTRAPOLATION_MARGIN`; inside the measured range a line through a convex curve is above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pretuner.units import GIB

EXTRAPOLATION_MARGIN = 0.05
LENGTH_GRID = 256  # lengths the search tries are multiples of this
CONVERGED_TOKENS = 1024  # the search stops when fit and failure are this close


@dataclass(frozen=True, slots=True)
class Measured:
    """A pre-run that ran: weights+activations at this length, from its pool dump."""

    length: int
    wa_bytes: int


@dataclass(frozen=True, slots=True)
class Bound:
    """A pre-run that ran out of memory: weights+activations at this length exceed this."""

    length: int
    wa_min_bytes: int


@dataclass
class WaModel:
    """Weights+activations against max_model_len for one batched-token policy."""

    weights_bytes: int
    prior_bytes: int = 0  # what a prefill needs besides the weights at length 0 (the plan's)
    measured: list[Measured] = field(default_factory=list)
    bounds: list[Bound] = field(default_factory=list)
    min_slope: float = 0.0  # bytes per token: a floor from the model's shape
    # Of the activations one measurement shows, the share that grows with the length: all of
    # it for whole-prompt steps; with chunked prefill a step's tokens are fixed and only the
    # attention over the context grows (taken as half, generously).
    growing_share: float = 1.0

    def _line(self) -> tuple[float, float, float]:
        """(anchor length, anchor WA, slope) of the fit before bounds."""
        pts = sorted(self.measured, key=lambda p: p.length)
        if len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            slope = (b.wa_bytes - a.wa_bytes) / (b.length - a.length)
            return float(b.length), float(b.wa_bytes), max(slope, self.min_slope)
        if pts:
            p = pts[0]
            slope = self.growing_share * (p.wa_bytes - self.weights_bytes) / max(1, p.length)
            return float(p.length), float(p.wa_bytes), max(slope, self.min_slope)
        return 0.0, float(self.weights_bytes + self.prior_bytes), self.min_slope

    def slope_and_anchor(self) -> tuple[float, float, float]:
        anchor_len, anchor_wa, slope = self._line()
        for b in self.bounds:
            if b.length > anchor_len:
                slope = max(slope, (b.wa_min_bytes - anchor_wa) / (b.length - anchor_len))
        return anchor_len, anchor_wa, slope

    def predict(self, length: int) -> int:
        """Predicted WA at `length`, with the extrapolation margin beyond the measured range."""
        exact = [p.wa_bytes for p in self.measured if p.length == length]
        if exact:
            return max(exact)
        below = [p for p in self.measured if p.length < length]
        above = [p for p in self.measured if p.length > length]
        floor = max((b.wa_min_bytes for b in self.bounds if b.length <= length), default=0)
        if below and above:
            # Between two measurements: their chord (WA grows with the length and, with the
            # attention's quadratic part, faster at the top, so the chord does not undershoot).
            a = max(below, key=lambda p: p.length)
            b = min(above, key=lambda p: p.length)
            share = (length - a.length) / (b.length - a.length)
            wa = a.wa_bytes + (b.wa_bytes - a.wa_bytes) * share
            return int(max(wa, floor, self.weights_bytes))
        anchor_len, anchor_wa, slope = self.slope_and_anchor()
        wa = anchor_wa + slope * (length - anchor_len)
        longest = max((p.length for p in self.measured), default=0)
        if length > longest:
            base = max((p.wa_bytes for p in self.measured if p.length == longest),
                       default=self.weights_bytes)
            wa = base + (wa - base) * (1 + EXTRAPOLATION_MARGIN)
        return int(max(wa, floor, self.weights_bytes))


def kv_blocks_for_one(length: int, block_size: int, watermark: float) -> int:
    """Blocks a KV cache needs so that one `length`-token sequence is admitted beside the
    engine's watermark (`int(watermark * blocks)` blocks kept free)."""
    need = -(-length // block_size)
    blocks = need
    while blocks - int(watermark * blocks) < need:
        blocks += 1
    return blocks


@dataclass(frozen=True, slots=True)
class Budget:
    """What the final configuration can spend.

    The pool may reach `pool_bytes` (the free memory less a hard margin) only by the integer
    rounding of the model-use budget, which it holds but nothing uses; what is used (weights,
    activations, headroom, KV) must stay within `used_bytes` (the free memory less the
    reserve).
    """

    pool_bytes: int
    used_bytes: int
    kv_bytes_per_token: int
    block_size: int
    watermark: float
    headroom_one_seq_bytes: int  # headroom of a configuration that serves one sequence,
    headroom_share: float = 0.0  # plus this share of the activations (WA - weights)
    weights_bytes: int = 0

    def headroom(self, wa_bytes: int) -> int:
        act = max(0, wa_bytes - self.weights_bytes)
        return self.headroom_one_seq_bytes + int(self.headroom_share * act)

    def model_use_bytes(self, wa_bytes: int) -> int:
        need = wa_bytes + self.headroom(wa_bytes)
        return math.ceil(need / GIB - 1e-9) * GIB  # r0.1 takes whole GiB

    def fits(self, length: int, wa_bytes: int) -> bool:
        """One sequence of `length` fits beside this WA (headroom and rounding included)."""
        blocks = kv_blocks_for_one(length, self.block_size, self.watermark)
        kv = blocks * self.block_size * self.kv_bytes_per_token
        used = wa_bytes + self.headroom(wa_bytes) + kv
        # The pool also keeps the block a pre-run keeps spare (`Tuner.prerun_most`), so a
        # length that fits here can be pre-run with the model-use it needs.
        spare = self.block_size * self.kv_bytes_per_token
        return used <= self.used_bytes and (
            self.model_use_bytes(wa_bytes) + kv + spare <= self.pool_bytes
        )


def edge(model: WaModel, budget: Budget, upto: int, grid: int = LENGTH_GRID,
         exact: bool = False) -> int:
    """The longest multiple of `grid` up to `upto` (or `upto` itself when `exact`: the
    requested length) that the model predicts fits; 0 if none."""
    best, n = 0, grid
    while n <= upto:
        if budget.fits(n, model.predict(n)):
            best = n
        n += grid
    if exact and upto % grid and budget.fits(upto, model.predict(upto)):
        best = upto
    return best


def next_length(model: WaModel, budget: Budget, *, requested: int, longest_fit: int | None,
                shortest_fail: int | None, minimum: int, failures: int = 0) -> int | None:
    """The next length to pre-run (the predicted edge inside the bracket), or None when the
    search is done."""
    hi = requested if shortest_fail is None else shortest_fail - 1
    if longest_fit is not None:
        if longest_fit >= requested:
            return None
        if shortest_fail is not None and shortest_fail - longest_fit <= CONVERGED_TOKENS:
            return None
    target = edge(model, budget, hi, exact=shortest_fail is None)
    lo = longest_fit or 0
    if longest_fit is not None and target < longest_fit + CONVERGED_TOKENS:
        return None
    if target <= lo:
        # Nothing predicted to fit above what is known: go halfway down from the failure, so a
        # wrong prediction costs one launch, not the run.
        target = max(minimum, (lo + hi) // 2 // LENGTH_GRID * LENGTH_GRID) if lo else minimum
        if longest_fit is not None and target <= longest_fit:
            return None
    if shortest_fail is not None and failures >= 2:
        # At most halfway: bounds that only say "more than this" must not walk the search a
        # step at a time.
        low = longest_fit if longest_fit is not None else minimum
        half = (low + shortest_fail) // 2 // LENGTH_GRID * LENGTH_GRID
        target = min(target, max(minimum, half))
        if longest_fit is not None and target <= longest_fit:
            return None
    target = max(target, minimum)
    if shortest_fail is not None and target >= shortest_fail:
        return None  # the minimum itself failed: nothing left to try
    return target
