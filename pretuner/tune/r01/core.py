"""`TunerCore`: the state every decision reads (the card, the measured peaks, the reserve and
the budget the final configuration will have), the launches, and the derivation at the final
util (the card's free memory less the reserve, raised by the integer rounding of the model-use
budget)."""

from __future__ import annotations

from collections.abc import Iterator

from pretuner import noise
from pretuner.engines.base import LaunchSettings
from pretuner.engines.outcome import Executor, LaunchOutcome
from pretuner.errors import CardBusyError, InfeasibleError
from pretuner.kvmath import kv_bytes_per_token, num_kv_blocks
from pretuner.method import Derivation, PrerunInputs, derive, per_sequence_bytes
from pretuner.plan.layout import PlanConfig, activation_bytes, smallest_weights_layout
from pretuner.tune import busy
from pretuner.tune.busy import DeviceBusyRefusal
from pretuner.tune.execute import Phase
from pretuner.tune.r01 import budget as bud
from pretuner.tune.r01.config import (
    CHUNKED_GROWING_SHARE,
    TIGHTEN_MARGIN_SHARE,
    TuneConfig,
    TuneResult,
    kv_prerun_bytes,
    plan_for,
    prerun_util,
)
from pretuner.tune.r01.search import Budget, WaModel
from pretuner.tune.setup import Method, OnDecision
from pretuner.units import GIB, MIB


class TunerCore(Method):
    """The decision procedure's state; launches go through `execute` (tests and --resume replay)."""

    @property
    def seen(self) -> str:
        """How a launch's figures were obtained, as the messages say it."""
        return "simulated" if self.cfg.provenance == "simulated" else "measured"

    def __init__(
        self, cfg: TuneConfig, execute: Executor, phase: Phase,
        on_decision: OnDecision = None,
    ) -> None:
        super().__init__(execute, phase, on_decision, cfg.max_launches)
        self.cfg = cfg
        self.plan = plan_for(cfg)
        self.bpt = kv_bytes_per_token(
            cfg.model, tp=self.plan.tp, pp=self.plan.pp, kv_dtype=cfg.kv_cache_dtype
        )
        self.weights_bytes = self.plan.weights_bytes_per_card
        self.free: bud.FreeMemory | None = (
            bud.FreeMemory(cfg.card.free_mib, f"{cfg.card.source} ({cfg.provenance})", False)
            if cfg.card.free_mib is not None
            else None
        )
        self.util_cap = 1.0  # lowered when the device refuses a pool
        tp = self.plan.tp
        # Before anything is measured, the plan's prediction: a workspace plus activations
        # growing with the prompt (whole steps) or those of one chunk (chunked prefill).
        slope = float(activation_bytes(cfg.model, 2, tp) - activation_bytes(cfg.model, 1, tp))
        workspace = activation_bytes(cfg.model, 0, tp)
        self.models = {
            False: WaModel(self.weights_bytes, prior_bytes=workspace, min_slope=slope),
            True: WaModel(
                self.weights_bytes, prior_bytes=activation_bytes(cfg.model, cfg.chunk_tokens, tp),
                growing_share=CHUNKED_GROWING_SHARE,
            ),
        }
        self.fits: dict[bool, dict[int, LaunchOutcome]] = {False: {}, True: {}}
        self.fails: dict[bool, set[int]] = {False: set(), True: set()}
        self.per_seq = per_sequence_bytes(cfg.model.vocab_size)
        self.base_headroom = bud.BASE_HEADROOM_FLOOR_BYTES
        # MiB the device held outside MindSpore's pool after its free-memory reading, the most
        # any launch showed (None: no device reader sampled a launch whose pool was up).
        self.outside_mib: int | None = None
        self.free_readings: list[int] = []  # MiB free, as MindSpore's init lines read it
        self.spread = 0  # MiB: the boot-to-boot spread of the proof peaks measured so far
        self.reserves: dict[int, float] = {}  # id(derivation) -> the reserve it kept, GiB

    def launch(self, settings: LaunchSettings) -> LaunchOutcome:
        try:
            outcome = super().launch(settings)
        except DeviceBusyRefusal as err:
            raise self.busy_error(err.free_mib, err.source, log_path=err.log_path) from err
        self.learn_card(outcome)
        return outcome

    def learn_card(self, o: LaunchOutcome) -> None:
        """Keep what a launch measured of the card: free memory and the weights."""
        if o.device_free_mib:
            self.free = self.engine_free(
                o.device_free_mib, f"MindSpore init line ({self.cfg.provenance})"
            )
            top = bud.max_pool_util(self.cfg.card.card_gib, self.free)
            self.check_free(o.device_free_mib, "MindSpore's init line", top, o.log_path)
        if o.worst_peak_mib is not None and o.device_peaks_mib and o.device_total_mib \
                and o.device_free_mib and not self.cfg.pool_on_demand:
            # The pool was up (its dump was read), so the device held it whole.
            cap_mib = o.settings.card_gib * o.settings.util * 1024
            outside = bud.outside_pool_mib(max(o.device_peaks_mib.values()),
                                           o.device_total_mib, o.device_free_mib, cap_mib)
            self.outside_mib = max(self.outside_mib or 0, outside)
        if o.weights_gib:
            self.weights_bytes = int(o.weights_gib * GIB)
            for m in self.models.values():
                m.weights_bytes = self.weights_bytes

    def engine_free(self, mib: int, source: str) -> bud.FreeMemory:
        """The free memory MindSpore read, with how far its readings have moved so far."""
        self.free_readings.append(mib)
        spread = max(self.free_readings) - min(self.free_readings)
        return bud.FreeMemory(mib, source, True, spread)

    # -- memory the final configuration will have -------------------------------------------
    def reserve(self) -> float:
        measured = self.free is not None and self.free.measured_by_engine
        return bud.reserve_gib(
            self.cfg.card.card_gib, measured_by_engine=measured, given=self.cfg.reserve_gib,
            outside_mib=self.outside_mib,
            spread_mib=self.free.spread_mib if self.free is not None else 0,
        )

    def reserve_words(self) -> str:
        """The reserve and where it comes from, as the derivation's source says it."""
        reserve = self.reserve()
        text = f"{reserve * 1024:,.0f} MiB reserve"
        if self.cfg.reserve_gib is not None:
            return text + " (--reserve-gb)"
        if self.free is not None and self.free.measured_by_engine and self.outside_mib is not None:
            margin = bud.hard_margin_gib(self.cfg.card.card_gib, self.free.spread_mib) * 1024
            moved = (f", {self.free.spread_mib:,} MiB of it how far the free memory moved "
                     "between launches" if self.free.spread_mib else "")
            return (text + f" ({self.outside_mib:,} MiB the device held outside the pool, "
                    f"{self.seen}, + {margin:.0f} MiB margin{moved})")
        if self.cfg.pool_on_demand:
            return text + (" (scaled to the card: MindSpore maps its pool as it grows, "
                           "enable_vmm, so the device cannot show what lies outside it)")
        return text + " (scaled to the card: no device reading of memory outside the pool)"

    def max_util(self, current: float) -> float:
        """The util later pre-runs use: the largest pool the measured free memory allows."""
        if self.free is None or not self.free.measured_by_engine:
            return current
        return min(self.util_cap, bud.max_pool_util(self.cfg.card.card_gib, self.free))

    def budget(self, util: float) -> Budget:
        card = self.cfg.card.card_gib
        if self.free is not None:
            free = self.free.mib * MIB
            # The largest pool a launch can get: util floored as the launches floor it.
            top = min(self.util_cap, bud.max_pool_util(card, self.free))
            pool = int(card * GIB * top)
            used = int(min(free - self.reserve() * GIB, pool))
        else:
            pool = used = int(card * util * GIB)
        return Budget(
            pool_bytes=pool, used_bytes=used, kv_bytes_per_token=self.bpt,
            block_size=self.cfg.block_size, watermark=self.cfg.watermark,
            headroom_one_seq_bytes=self.floor_bytes(), headroom_share=TIGHTEN_MARGIN_SHARE,
            weights_bytes=self.weights_bytes,
        )

    def floor_bytes(self) -> int:
        """The least headroom a proven configuration keeps in its pool (`pretuner.noise`): the
        boot-noise floor, or the spread this run's boots measured."""
        return noise.floor_mib(self.cfg.card.card_gib * 1024, self.spread) * MIB

    def one_sequence_margin(self, wa_bytes: int | None = None) -> int:
        """Headroom of a configuration that serves one sequence: the pre-run measured exactly
        that load, so only the tightening margin is added (the floor and a share of the
        activations)."""
        act = max(0, (wa_bytes or 0) - self.weights_bytes)
        return self.floor_bytes() + int(TIGHTEN_MARGIN_SHARE * act)

    def wa_bytes(self, o: LaunchOutcome) -> int:
        """Weights + activations a pre-run measured: worst rank's peak - the KV it allocated."""
        assert o.worst_peak_mib is not None  # noqa: S101 - OK outcomes always carry a peak
        return o.worst_peak_mib * MIB - kv_prerun_bytes(o.settings, self.bpt)

    def full_load_non_kv(self, o: LaunchOutcome) -> int:
        """What a launch's worst rank held besides the KV cache (its pool dump), plus the
        allocation that failed when it ran out."""
        kv = kv_prerun_bytes(o.settings, self.bpt)
        return (o.worst_peak_mib or 0) * MIB - kv + (o.oom_alloc_bytes or 0)

    def oom_bound(self, o: LaunchOutcome) -> int:
        """What an out-of-memory pre-run proves: weights + activations exceed the pool it had
        besides the KV cache, and at least the dump's peak plus the allocation that failed."""
        kv = kv_prerun_bytes(o.settings, self.bpt)
        room = int(o.settings.card_gib * GIB * o.settings.util) - kv
        return max(room + 1, self.full_load_non_kv(o))

    # -- the loop ---------------------------------------------------------------------------

    def free_desc(self) -> str:
        if self.free is None:
            return "no free-memory reading"
        return f"{self.free.mib:,} MiB free ({self.free.source})"

    def layout_hint(self, default: str) -> str:
        cfg = PlanConfig(
            model=self.cfg.model, card_gib=self.cfg.card.card_gib, util=self.cfg.util,
            max_model_len=self.cfg.min_model_len, pp=self.cfg.pp,
            kv_cache_dtype=self.cfg.kv_cache_dtype, block_size=self.cfg.block_size,
            weights_format=self.cfg.weights_format,
        )
        tp = smallest_weights_layout(cfg)
        if tp is not None and tp > self.plan.tp:
            return f"use --tp {tp} or more"
        return default

    # -- a busy card ------------------------------------------------------------------------
    def need_bytes(self) -> int:
        """The least pool a pre-run can measure anything in: the weights and the KV cache of
        one --min-model-len sequence."""
        cfg = self.cfg
        blocks = num_kv_blocks(cfg.min_model_len * self.bpt, self.bpt, cfg.block_size) + 1
        return self.weights_bytes + blocks * cfg.block_size * self.bpt

    def busy_error(
        self, free_mib: int, source: str, log_path: str | None = None, why: str | None = None
    ) -> CardBusyError:
        return busy.card_busy_error(
            card_gib=self.cfg.card.card_gib, free_mib=free_mib, source=source,
            need_mib=-(-self.need_bytes() // MIB), holders=self.cfg.card.holders, log_path=log_path,
            why=why,
        )

    def check_start(self) -> None:
        """Before any launch: a card whose free memory (npu-smi) cannot hold the pre-run's pool
        is busy (another process on it) or, idle, smaller than assumed; never a util <= 0."""
        card = self.cfg.card
        if card.free_mib is not None:
            self.check_free(card.free_mib, f"{card.source} before the run", prerun_util(self.cfg))

    def check_free(
        self, free_mib: int, source: str, util: float, log_path: str | None = None
    ) -> None:
        card = self.cfg.card.card_gib
        if util > 0 and card * util * GIB >= self.need_bytes():
            return
        if busy.looks_busy(card, free_mib, self.cfg.card.holders):
            raise self.busy_error(free_mib, source, log_path)
        if util <= 0:
            raise InfeasibleError(
                f"the card has {free_mib:,} MiB free ({source}): no pool is left on a "
                f"{card} GiB card",
                hint="check --card against `npu-smi info`",
            )

    def busy_instead(self) -> None:
        """A "does not fit" verdict stands only at a card's normal free memory."""
        free = self.free.mib if self.free is not None else self.cfg.card.free_mib
        card = self.cfg.card.card_gib
        if free is not None and busy.looks_busy(card, free, ()):
            source = self.free.source if self.free is not None else self.cfg.card.source
            raise self.busy_error(
                free, source,
                why=f"{self.cfg.model.name} did not fit in what is left, which says nothing "
                "about an idle card",
            )  # fmt: skip

    def lower_util(self, util: float, outcome: LaunchOutcome, steps: Iterator[float]) -> float:
        if outcome.device_free_mib:
            free = self.engine_free(
                outcome.device_free_mib, f"the device's refusal ({self.cfg.provenance})"
            )
            self.free = free
            new = bud.max_pool_util(self.cfg.card.card_gib, free)
            self.check_free(free.mib, "the device's refusal", new, outcome.log_path)
            why = f"MindSpore reports {outcome.device_free_mib:,} MiB free"
        else:
            new = next((u for u in steps if u < util), 0.0)
            why = "the device refused the pool size; next step of the method's util ladder"
        if new <= 0 or new >= util:
            raise InfeasibleError(
                f"the card refuses util {util} and no lower util is left to try",
                hint="check `npu-smi info` for other processes on the card",
            )
        self.util_cap = new
        self.decide("lower util", why, util=new)
        return new

    # -- the derivation at the final util ---------------------------------------------------
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
        """The method at the final util (the module's docstring)."""
        per_seq = self.per_seq if per_seq is None else per_seq
        if base is None:
            wa = self.wa_bytes(prerun)
            # At least the boot-noise floor the proof must leave in the pool (`pretuner.noise`).
            base = self.base_headroom = max(
                self.base_headroom,
                bud.base_headroom_bytes(
                    wa, self.weights_bytes, prerun.rank_peaks_mib, self.cfg.headroom_gib
                ),
                self.floor_bytes(),
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
            plan=self.plan, derivation=d, validated=validated, outcomes=tuple(self.outcomes),
            decisions=tuple(self.decisions), final_util_source=source, prerun=prerun,
            validation=validation, reserve_gib=self.reserves.get(id(d), 0.0),
            pool_on_demand=self.cfg.pool_on_demand,
        )

