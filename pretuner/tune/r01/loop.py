"""`Tuner.run() -> TuneResult`: the r0.1 pre-run method. Plan the layout, pre-run (max-num-seqs
1, one max-length request that must really run) until the longest length that fits at the
memory the final configuration will have is known (`prerun`), derive at the final util
(`core`), and prove it under full load (`validation`). Never report an unproven configuration.
"""

from __future__ import annotations

from pretuner.tune.r01.config import TuneResult, prerun_util
from pretuner.tune.r01.prerun import PrerunSearch
from pretuner.tune.r01.validation import Validation


class Tuner(PrerunSearch, Validation):
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
