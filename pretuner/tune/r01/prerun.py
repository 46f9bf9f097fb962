"""`PrerunSearch`: pre-run until the longest length that fits is known, falling back by cause
(util, KV for the watermark, chunked prefill, length), every fit judged at the final memory."""

from __future__ import annotations

import math
from dataclasses import replace

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.errors import (
    InfeasibleError,
    NotValidatedError,
)
from pretuner.tune.busy import crash_error
from pretuner.tune.r01 import budget as bud
from pretuner.tune.r01.config import (
    CHUNK_GRID,
    UTIL_LADDER,
)
from pretuner.tune.r01.core import TunerCore
from pretuner.tune.r01.search import (
    Bound,
    Measured,
    kv_blocks_for_one,
    next_length,
)
from pretuner.units import GIB


class PrerunSearch(TunerCore):

    def prerun_most(self, util: float, length: int) -> int:
        """The largest integer model-use leaving KV for one sequence beside the watermark."""
        blocks = kv_blocks_for_one(length, self.cfg.block_size, self.cfg.watermark)
        need = (blocks + 1) * self.cfg.block_size * self.bpt
        return math.floor((self.cfg.card.card_gib * util * GIB - need) / GIB)

    def prerun_settings(
        self, util: float, length: int, model_use: int | None = None, chunked: bool = False
    ) -> LaunchSettings:
        """The method's pre-run: max-num-seqs 1, one long request."""
        cfg = self.cfg
        if model_use is None:
            model_use = self.prerun_most(util, length)
            if cfg.model_use_gib is not None:
                model_use = min(cfg.model_use_gib, model_use)
        return LaunchSettings(
            purpose=Purpose.PRERUN, card_gib=cfg.card.card_gib, util=util, model_use_gib=model_use,
            max_model_len=length, max_num_seqs=1,
            max_num_batched_tokens=min(length, cfg.chunk_tokens) if chunked else length,
            block_size=cfg.block_size, tp=self.plan.tp, pp=self.plan.pp,
            kv_cache_dtype=cfg.kv_cache_dtype, chunked_prefill=chunked,
        )

    def search(self, util: float) -> LaunchOutcome:
        """Pre-run until the longest length that fits is known; returns its pre-run."""
        cfg = self.cfg
        length, chunked = cfg.max_model_len, False
        pinned = cfg.model_use_gib
        kv_extra = 0  # GiB more KV than computed, after the engine dropped the probe
        retried: set[tuple[int, bool]] = set()
        util_steps = iter(UTIL_LADDER)
        reserve_for_validation = 1 if cfg.validate else 0
        while True:
            if self.launches_left() <= reserve_for_validation and any(self.fits.values()):
                self.decide("stop narrowing", "the launch budget is kept for the validation")
                break
            most = self.prerun_most(util, length) - kv_extra
            mu = most if pinned is None else min(pinned, most)
            if mu < 1:
                bigger = self.max_util(util)
                if bigger > util + 1e-4:
                    util = bigger
                    continue
                self.fails[chunked].add(length)
                self.decide(
                    "shorten max_model_len",
                    f"the KV cache of one {length:,}-token sequence beside the block watermark "
                    f"does not fit in card*util = {cfg.card.card_gib * util:.2f} GiB",
                )
            else:
                o = self.launch(self.prerun_settings(util, length, mu, chunked))
                k = o.kind
                if k is OutcomeKind.DEVICE_REFUSED:
                    util = self.lower_util(util, o, util_steps)
                    continue
                if k in (OutcomeKind.PROMPT_DROPPED, OutcomeKind.KV_EXHAUSTED,
                         OutcomeKind.LEN_TOO_LARGE):
                    kv_extra += 1
                    self.decide(
                        "give the pre-run more KV",
                        f"{k.value} at {length:,} with model-use {mu} GiB: the probe did not run, "
                        f"so nothing was {self.seen}; 1 GiB more KV for one max-length sequence "
                        "beside the engine's block watermark",
                        model_use_gib=mu - 1,
                    )
                    continue
                if k is OutcomeKind.REQUESTS_FAILED:
                    raise crash_error(o, "pre-run's probe")
                if pinned is not None and mu < most and k.is_oom:
                    pinned = None
                    self.decide(
                        "raise model-use",
                        f"{k.value} with model-use {mu} GiB; the most {length:,} tokens allow is "
                        f"{most} GiB (below card*util)",
                        model_use_gib=most,
                    )
                    continue
                if k is OutcomeKind.OOM_WEIGHTS:
                    bigger = self.max_util(util)
                    if bigger > util + 1e-4 and (length, chunked) not in retried:
                        retried.add((length, chunked))
                        self.decide(
                            "retry at the card's free memory",
                            f"the weights did not fit at util {util:g}; the card has "
                            f"{self.free_desc()}: util {bigger:g} before the layout is given up",
                            util=bigger,
                        )
                        util = bigger
                        continue
                    self.weights_do_not_fit(o)
                kv_extra = 0
                if k is OutcomeKind.OK:
                    self.measured(o, length, chunked)
                else:
                    bound = self.oom_bound(o)
                    bigger = self.max_util(util)
                    if (
                        bigger > util + 1e-4
                        and (length, chunked) not in retried
                        and self.budget(util).fits(length, bound)
                    ):
                        retried.add((length, chunked))
                        self.decide(
                            "retry at the card's free memory",
                            f"{k.value} at util {util:g}; the card has {self.free_desc()}, so "
                            f"the final configuration gets util {bigger:g}: the same length is "
                            "tried there before anything is shortened",
                            util=bigger,
                        )
                        util = bigger
                        continue
                    self.fails[chunked].add(length)
                    self.models[chunked].bounds.append(Bound(length, bound))
                    if not chunked and length > 4 * cfg.chunk_tokens and not self.fits[False]:
                        chunked = True
                        self.decide(
                            "prefill in chunks",
                            f"{k.value} at {length:,} tokens in one prefill step (weights + "
                            f"activations over {bound / GIB:.2f} GiB); chunked prefill with "
                            f"{cfg.chunk_tokens:,}-token steps keeps the length",
                            max_num_batched_tokens=cfg.chunk_tokens,
                        )
                        util = self.max_util(util)
                        continue
                util = self.max_util(util)
            nxt = self.next_length(chunked)
            if nxt is None:
                break
            self.decide(
                "shorten max_model_len" if nxt < length else "lengthen max_model_len",
                self.why_length(chunked, nxt), max_model_len=nxt,
            )
            length = nxt
        return self.finish_search(chunked, util)

    def measured(self, o: LaunchOutcome, length: int, chunked: bool) -> None:
        wa = self.wa_bytes(o)
        self.base_headroom = bud.base_headroom_bytes(
            wa, self.weights_bytes, o.rank_peaks_mib, self.cfg.headroom_gib
        )
        self.models[chunked].measured.append(Measured(length, wa))
        if self.budget(o.settings.util).fits(length, wa):
            self.fits[chunked][length] = o
            return
        self.fails[chunked].add(length)
        self.decide(
            f"{self.seen}, but too long",
            f"{length:,} tokens ran with weights+activations {wa / GIB:.2f} GiB, but the final "
            f"headroom and integer model-use leave no KV for one sequence within "
            f"{self.free_desc()}",
        )

    def bracket(self, chunked: bool) -> tuple[int | None, int | None]:
        fits = self.fits[chunked]
        lo = max(fits) if fits else None
        above = [n for n in self.fails[chunked] if lo is None or n > lo]
        return lo, (min(above) if above else None)

    def next_length(self, chunked: bool) -> int | None:
        lo, hi = self.bracket(chunked)
        return next_length(
            self.models[chunked], self.budget(self.cfg.util), requested=self.cfg.max_model_len,
            longest_fit=lo, shortest_fail=hi, minimum=self.cfg.min_model_len,
            failures=sum(1 for n in self.fails[chunked] if lo is None or n > lo),
        )

    def why_length(self, chunked: bool, nxt: int) -> str:
        lo, hi = self.bracket(chunked)
        known = []
        if lo is not None:
            known.append(f"{lo:,} fits ({self.seen})")
        if hi is not None:
            known.append(f"{hi:,} does not")
        wa = self.models[chunked].predict(nxt)
        return (
            f"{'; '.join(known) or f'nothing {self.seen} yet'}; the {self.seen} peaks predict "
            f"weights+activations of {wa / GIB:.2f} GiB at {nxt:,}, which the final configuration "
            "holds"
        )

    def finish_search(self, chunked: bool, util: float) -> LaunchOutcome:
        cfg = self.cfg
        fits = self.fits[chunked]
        if not fits:
            return self.nothing_fits(chunked)
        length = max(fits)
        best = fits[length]
        if chunked:
            best = self.widen_chunks(best, util)
        if length < cfg.max_model_len:
            _, hi = self.bracket(chunked)
            self.decide(
                "keep max_model_len",
                f"{length:,} tokens is the longest {self.seen} to fit"
                + (f"; {hi:,} did not" if hi else "")
                + f" (asked: {cfg.max_model_len:,})",
                max_model_len=length,
            )
        return best

    def nothing_fits(self, chunked: bool) -> LaunchOutcome:
        cfg = self.cfg
        _, hi = self.bracket(chunked)
        if hi is not None and hi <= cfg.min_model_len:
            self.busy_instead()
            raise InfeasibleError(
                f"{cfg.model.name} does not fit TP{self.plan.tp} on {cfg.card.card_gib} GiB "
                f"cards even at --min-model-len {cfg.min_model_len:,} ({self.seen} at the card's "
                f"free memory: {self.free_desc()})",
                hint=self.layout_hint("add cards (--tp)")
                + ", use a quantized checkpoint, or lower --min-model-len",
            )
        raise NotValidatedError(
            f"no length from {cfg.min_model_len:,} to {cfg.max_model_len:,} was {self.seen} to fit "
            f"within {cfg.max_launches} launches",
            hint="raise --max-launches, or read the run record's decisions",
        )

    def weights_do_not_fit(self, o: LaunchOutcome) -> None:
        cfg = self.cfg
        self.busy_instead()
        raise InfeasibleError(
            f"TP{self.plan.tp} x PP{self.plan.pp}: the weights of {cfg.model.name} did not fit "
            f"on a {cfg.card.card_gib} GiB card: out of memory before they finished loading "
            f"({o.oom_text or 'see the log'}; {self.seen}, log {o.log_path})",
            hint=self.layout_hint("add cards (--tp/--pp)") + ", or a quantized --weights-format",
        )

    def widen_chunks(self, best: LaunchOutcome, util: float) -> LaunchOutcome:
        """The largest chunk budget that costs no KV cache: the measured peaks say its
        activations stay within the integer model-use budget the default chunk rounds up to.
        Confirmed by one pre-run; the default chunk stands if that fails."""
        cfg, s = self.cfg, best.settings
        length, chunk = s.max_model_len, s.max_num_batched_tokens
        wa_chunk = self.wa_bytes(best)
        whole = self.models[False]
        bound = max((b.wa_min_bytes for b in whole.bounds if b.length <= length), default=0)
        if not bound or self.launches_left() <= (2 if cfg.validate else 1):
            return best
        budget = self.budget(util)
        room = budget.model_use_bytes(wa_chunk) - budget.headroom(wa_chunk)
        slope = max(0.0, (bound - wa_chunk) / max(1, length - chunk))
        target = 0
        b = (length - 1) // CHUNK_GRID * CHUNK_GRID
        while b >= 2 * chunk:
            if wa_chunk + slope * (b - chunk) * (1 + 0.05) <= room:
                target = b
                break
            b -= CHUNK_GRID
        if not target:
            return best
        self.decide(
            "try a larger chunk",
            f"{chunk:,}-token prefill steps fit with weights+activations {wa_chunk / GIB:.2f} "
            f"GiB and whole {length:,}-token steps do not; the {self.seen} peaks predict "
            f"{target:,}-token steps stay within the same {room / GIB:.2f} GiB (no KV lost, "
            "fewer steps per long prompt)",
            max_num_batched_tokens=target,
        )
        top = self.max_util(util)
        settings = replace(s, util=top, max_num_batched_tokens=target,
                           model_use_gib=self.prerun_most(top, length))
        o = self.launch(settings)
        if o.kind is OutcomeKind.OK and self.wa_bytes(o) <= room:
            return o
        self.decide("keep the chunk", f"{target:,}-token steps did not fit ({o.kind.value})")
        return best

