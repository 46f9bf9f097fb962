"""`Tuner.run() -> TuneResult`: the automated pre-run method with fallbacks and validation.

1. plan: pick or check the layout; a layout whose weights cannot fit is refused before launch.
2. pre-run: GLOG_v=1, max-num-seqs 1, one max-length request that must really run.
3. every decision at the memory the final configuration will have: once a launch measured the
   card's free memory, later pre-runs use the largest pool it allows and every fit is judged
   with the final headroom and integer rounding (`pretuner.tune.r01.search.Budget`).
4. fall back by cause; between the longest length that fits and the shortest that does not,
   narrow with the measured peaks (`pretuner.tune.r01.search`) until they are within 1024 tokens;
   when a whole-prompt prefill step is what does not fit, prefill in chunks instead.
5. validate: max-num-seqs concurrent max-length requests. A validation that runs out of memory
   teaches the per-sequence cost from its own pool dump; one that passes with room to spare is
   tightened once with what it measured. Never report an unproven configuration.
"""

from __future__ import annotations

from pretuner.tune.r01.config import TuneResult, prerun_util
from pretuner.tune.r01.prerun import PrerunSearch
from pretuner.tune.r01.validation import Validation


class Tuner(PrerunSearch, Validation):
    """The automated pre-run method: plan, search the longest length that fits, derive at the
    final util, validate."""

    def run(self) -> TuneResult:
        cfg = self.cfg
        self.decide(
            "layout", self.plan.layout_reason, tp=self.plan.tp, pp=self.plan.pp,
            nodes=self.plan.nodes,
        )
        for note in self.plan.notes:
            self.decide("layout note", note)
        self.check_start()  # a busy card ends the run here, before any util is derived
        util = prerun_util(cfg)
        if util < cfg.util:
            self.decide(
                "lower pre-run util",
                f"the card has {cfg.card.free_mib:,} MiB free ({cfg.card.source}); "
                f"util {cfg.util} would ask more",
                util=util,
            )
        best = self.search(util)
        derivation, source = self.derive(best)
        if not cfg.validate:
            self.decide("skip validation", "--no-validate: the configuration is NOT proven")
            return self.result(derivation, False, source, best, None)
        return self.validate(best, derivation, source)
