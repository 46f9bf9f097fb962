"""`Deriving`: the method's derivation at the final util (the card's free memory less the
reserve, raised by the integer rounding of the model-use budget), and the run's result."""

from __future__ import annotations

from pretuner.engines.outcome import LaunchOutcome
from pretuner.errors import InfeasibleError
from pretuner.method import Derivation, PrerunInputs, derive
from pretuner.tune.r01 import budget as bud
from pretuner.tune.r01.config import TuneResult
from pretuner.tune.r01.core import TunerCore
from pretuner.units import GIB, MIB


class Deriving(TunerCore):
    def prerun_inputs(
        self, o: LaunchOutcome, util: float, per_seq: int, base: int
    ) -> PrerunInputs:
        s = o.settings
        assert o.worst_peak_mib is not None  # noqa: S101 - OK outcomes always carry a peak
        return PrerunInputs(
            card_gib=s.card_gib, util=s.util, model_use_gib=s.model_use_gib,
            actual_peak_mib=o.worst_peak_mib, kv_bytes_per_token=self.bpt, block_size=s.block_size,
            max_model_len=s.max_model_len, headroom_gib=base / GIB,
            max_num_batched_tokens=s.max_num_batched_tokens, final_util=util, per_seq_bytes=per_seq,
            watermark=self.cfg.watermark,
        )

    def derive(
        self, prerun: LaunchOutcome, per_seq: int | None = None, base: int | None = None,
        announce: bool = True,
    ) -> tuple[Derivation, str]:
        """The method at the final util: the card's free memory less the reserve, raised by
        the integer rounding of the model-use budget."""
        per_seq = self.per_seq if per_seq is None else per_seq
        if base is None:
            wa = self.wa_bytes(prerun)
            base = self.base_headroom = max(
                self.base_headroom,
                bud.base_headroom_bytes(
                    wa, self.weights_bytes, prerun.rank_peaks_mib, self.cfg.headroom_gib
                ),
            )
        try:
            return self._derive(prerun, per_seq, base, announce)
        except InfeasibleError:
            tight = self.one_sequence_margin(self.wa_bytes(prerun))
            if base <= tight:
                raise
        self.decide(
            "one sequence",
            f"with {base / MIB:,.0f} MiB of headroom no sequence of "
            f"{prerun.settings.max_model_len:,} tokens fits; the pre-run {self.seen} exactly one "
            f"such sequence, so {tight / MIB:,.0f} MiB above it is kept",
        )
        return self._derive(prerun, per_seq, tight, announce)

    def _derive(
        self, prerun: LaunchOutcome, per_seq: int, base: int, announce: bool
    ) -> tuple[Derivation, str]:
        card = self.cfg.card.card_gib
        if self.free is None:
            util = prerun.settings.util
            source = "the pre-run's util (no free-memory reading)"
            d = derive(self.prerun_inputs(prerun, util, per_seq, base))
        else:
            reserve = self.reserve()
            # The rounding does not depend on util (the model-use budget is weights+activations
            # plus headroom): learn it at the largest pool, then give it back within reach.
            top = min(self.util_cap, bud.max_pool_util(card, self.free))
            rounding = derive(self.prerun_inputs(prerun, top, per_seq, base)).rounding_cost_bytes
            outside = (self.outside_mib or 0) / 1024
            util = min(self.util_cap,
                       bud.pool_util(card, self.free, reserve, rounding / GIB, outside))
            d = derive(self.prerun_inputs(prerun, util, per_seq, base))
            self.reserves[id(d)] = reserve
            source = f"{self.free.source}: {self.free.mib:,} MiB free - {self.reserve_words()}"
            if util > bud.pool_util(card, self.free, reserve):
                source += (
                    f" + {d.rounding_cost_bytes / GIB:.2f} GiB of integer rounding given back to "
                    "the KV cache"
                )
        if not announce:
            return d, source
        self.decide(
            "derive",
            f"worst-rank peak {prerun.worst_peak_mib:,} MiB -> weights+activations "
            f"{d.weights_act_gib:.2f} GiB; final util {util} from {source}",
            vllm_model_memory_use_gb=d.final.vllm_model_memory_use_gb, gpu_memory_utilization=util,
            max_num_seqs=d.final.max_num_seqs, kv_gib=round(d.final.kv_bytes / GIB, 3),
        )
        return d, source

    def result(
        self, d: Derivation, validated: bool, source: str, prerun: LaunchOutcome | None,
        validation: LaunchOutcome | None,
    ) -> TuneResult:
        return TuneResult(
            plan=self.plan, derivation=d, validated=validated, outcomes=tuple(self.state.outcomes),
            decisions=tuple(self.state.decisions), final_util_source=source, prerun=prerun,
            validation=validation, reserve_gib=self.reserves.get(id(d), 0.0),
            pool_on_demand=self.cfg.pool_on_demand,
        )

