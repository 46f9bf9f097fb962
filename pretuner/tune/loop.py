"""`tune(cfg) -> TuneResult`: the automated pre-run method with fallbacks and validation.

1. plan: pick or check the layout; impossible layouts are refused before any launch.
2. pre-run: GLOG_v=1, max-num-seqs 1, batched = max_model_len, one max-length request.
3. derive from the worst rank's peak (pretuner.method), final util from the card's free memory.
4. fall back by cause; between the longest length that fits and the shortest that does not,
   jump to the largest length the measured peaks say should fit, then confirm it.
5. validate: max-num-seqs concurrent max-length requests; never report an unproven config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pretuner.errors import InfeasibleError, NotValidatedError, ServerFailedError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens
from pretuner.method import Derivation, PrerunInputs, derive, per_sequence_bytes
from pretuner.models.spec import ModelSpec
from pretuner.plan import PlanConfig, PlanResult, activation_bytes, plan
from pretuner.tune.execute import LaunchContext, LaunchOutcome, OutcomeKind, Phase, run_launch
from pretuner.tune.record import RunRecord
from pretuner.tune.settings import LaunchSettings, Purpose
from pretuner.units import GIB, MIB

log = logging.getLogger(__name__)

# Kept free below the card's measured free memory when choosing the final util: CANN and HCCL
# allocate outside MindSpore's pool after npu-smi was read (seed 003: "non-framework < 1 GB").
DEFAULT_RESERVE_GIB = 1.0
# When MindSpore's own init line measured the free memory (CANN already counted), less will do.
MEASURED_RESERVE_GIB = 0.25
# The pool cap never comes closer than this to the card's measured free memory.
HARD_MARGIN_GIB = 1 / 16
UTIL_LADDER = (0.87, 0.85, 0.8)  # seed 003: lower util when the device refuses
LEN_LADDER = (16384, 8192, 4096)
JUMP_STEP = 1024  # a jumped-to length is a multiple of this
JUMP_MARGIN = 0.03  # the fit's prediction is inflated by this before trusting it


@dataclass(frozen=True, slots=True)
class CardInfo:
    card_gib: int
    free_mib: int | None
    source: str  # "given", "npu-smi", "sim npu-smi"


@dataclass(frozen=True, slots=True)
class TuneConfig:
    model: ModelSpec
    card: CardInfo
    util: float = 0.9
    max_model_len: int = 16384
    min_model_len: int = 4096
    tp: int | None = None
    pp: int = 1
    nodes: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    weights_format: str | None = None
    headroom_gib: float = 0.5
    reserve_gib: float | None = None  # default: DEFAULT_RESERVE_GIB or MEASURED_RESERVE_GIB
    max_launches: int = 8
    validate: bool = True
    model_use_gib: int | None = None  # pin the pre-run's model-use (the seed's 50); default: max
    len_ladder: tuple[int, ...] = LEN_LADDER  # the backend's lengths to fall back through


@dataclass
class TuneState:
    """Everything the loop learned so far (rebuilt by replay on --resume)."""

    outcomes: list[LaunchOutcome] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TuneResult:
    plan: PlanResult
    derivation: Derivation
    validated: bool
    outcomes: tuple[LaunchOutcome, ...]
    decisions: tuple[dict[str, Any], ...]
    final_util_source: str


Executor = Callable[[LaunchSettings], LaunchOutcome]


def plan_for(cfg: TuneConfig) -> PlanResult:
    return plan(
        PlanConfig(
            model=cfg.model,
            card_gib=cfg.card.card_gib,
            util=cfg.util,
            max_model_len=cfg.max_model_len,
            tp=cfg.tp,
            pp=cfg.pp,
            nodes=cfg.nodes,
            kv_cache_dtype=cfg.kv_cache_dtype,
            block_size=cfg.block_size,
            weights_format=cfg.weights_format,
            headroom_gib=cfg.headroom_gib,
        )
    )


def floor_to(value: float, digits: int) -> float:
    scale = 10.0**digits
    return float(math.floor(value * scale + 1e-9)) / scale


def prerun_util(cfg: TuneConfig) -> float:
    """The method's 0.9, lowered when the card's free memory cannot give that much."""
    if cfg.card.free_mib is None:
        return cfg.util
    reserve = cfg.reserve_gib if cfg.reserve_gib is not None else DEFAULT_RESERVE_GIB
    cap = floor_to((cfg.card.free_mib * MIB / GIB - reserve) / cfg.card.card_gib, 2)
    return min(cfg.util, cap)


def prerun_model_use(card_gib: int, util: float, length: int, bpt: int, block: int) -> int:
    """The largest integer model-use that still leaves KV for one `length`-token sequence.

    The seed starts at 50 GiB; any value works for the measurement (the peak minus the KV the
    pre-run allocated is weights+activations whatever the split), so pretuner gives the
    weights and activations all the room it can: a pre-run then OOMs only when the model
    truly does not fit at this length.
    """
    need = (-(-length // block) + 1) * block * bpt
    return math.floor((card_gib * util * GIB - need) / GIB)


def final_util(
    cfg: TuneConfig, outcome: LaunchOutcome, rounding_gib: float = 0.0
) -> tuple[float, str]:
    """The util to run with: all the card's measured free memory less a documented reserve.

    `rounding_gib` is what rounding vLLM_MODEL_MEMORY_USE_GB up to an integer left unused in
    the pool: the util rises by that much to give it back to the KV cache, eating into the
    reserve but never closer than HARD_MARGIN_GIB to the free memory MindSpore checks against.
    """
    if outcome.device_free_mib:
        free, source = outcome.device_free_mib, "MindSpore init line (measured)"
        reserve = cfg.reserve_gib if cfg.reserve_gib is not None else MEASURED_RESERVE_GIB
    elif cfg.card.free_mib is not None:
        free, source = cfg.card.free_mib, f"{cfg.card.source} (measured)"
        reserve = cfg.reserve_gib if cfg.reserve_gib is not None else DEFAULT_RESERVE_GIB
    else:
        return outcome.settings.util, "the pre-run's util (no free-memory reading)"
    free_gib, card = free * MIB / GIB, cfg.card.card_gib
    util = floor_to((free_gib - reserve) / card, 3)
    if rounding_gib > 0:
        recovered = floor_to((free_gib - reserve + rounding_gib) / card, 3)
        util = max(util, min(recovered, floor_to((free_gib - HARD_MARGIN_GIB) / card, 3)))
    why = f"{source}: {free:,} MiB free - {reserve} GiB reserve"
    if rounding_gib > 0:
        why += f" + {rounding_gib:.2f} GiB of integer rounding given back to the KV cache"
    return min(1.0, util), why


class Tuner:
    """The decision procedure; launches go through `execute` so tests and --resume can replay."""

    def __init__(
        self,
        cfg: TuneConfig,
        execute: Executor,
        phase: Phase,
        on_decision: Callable[[dict[str, Any]], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.execute = execute
        self.phase = phase
        self.on_decision = on_decision
        self.state = TuneState()
        self.plan = plan_for(cfg)
        self.bpt = kv_bytes_per_token(
            cfg.model, tp=self.plan.tp, pp=self.plan.pp, kv_dtype=cfg.kv_cache_dtype
        )

    # -- bookkeeping ------------------------------------------------------------------------
    def decide(self, what: str, why: str, **data: Any) -> None:
        entry = {"decision": what, "reason": why, **data}
        self.state.decisions.append(entry)
        if self.on_decision is not None:
            self.on_decision(entry)
        log.info("decision: %s (%s)", what, why)
        self.phase("decide", f"{what}: {why}")

    def launch(self, settings: LaunchSettings) -> LaunchOutcome:
        if len(self.state.outcomes) >= self.cfg.max_launches:
            raise NotValidatedError(
                f"launch budget of {self.cfg.max_launches} used up before a configuration was "
                "validated",
                hint="raise --max-launches, or read the run record's decisions",
            )
        outcome = self.execute(settings)
        self.state.outcomes.append(outcome)
        return outcome

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> TuneResult:
        cfg = self.cfg
        self.decide(
            "layout",
            self.plan.layout_reason,
            tp=self.plan.tp,
            pp=self.plan.pp,
            nodes=self.plan.nodes,
        )
        if not self.plan.requested.fits and cfg.max_model_len <= cfg.min_model_len:
            raise InfeasibleError(
                f"{cfg.model.name} at --max-model-len {cfg.max_model_len:,} does not fit TP"
                f"{self.plan.tp} on {cfg.card.card_gib} GiB cards (predicted)",
                hint="add cards with --tp, or use a quantized --weights-format",
            )
        util = prerun_util(cfg)
        if util < cfg.util:
            self.decide(
                "lower pre-run util",
                f"the card has {cfg.card.free_mib:,} MiB free ({cfg.card.source}); "
                f"util {cfg.util} would ask more",
                util=util,
            )
        best = self.prerun(util)
        derivation, source = self.derive(best, cfg.headroom_gib)
        if not cfg.validate:
            self.decide("skip validation", "--no-validate: the configuration is NOT proven")
            return self.result(derivation, False, source)
        return self.validate(best, derivation, source)

    def prerun(self, util: float) -> LaunchOutcome:
        """Pre-run at the longest length that fits; returns the outcome to derive from."""
        cfg = self.cfg
        length = cfg.max_model_len
        fits: dict[int, LaunchOutcome] = {}
        fails: dict[int, LaunchOutcome | None] = {}
        jumped = False
        util_steps = iter(UTIL_LADDER)
        pinned = cfg.model_use_gib
        while True:
            most = prerun_model_use(cfg.card.card_gib, util, length, self.bpt, cfg.block_size)
            mu = most if pinned is None else min(pinned, most)
            if mu < 1:
                fails[length] = None
                self.decide(
                    "shorten max_model_len",
                    f"{length:,} tokens of KV do not fit in card*util = "
                    f"{cfg.card.card_gib * util:.2f} GiB",
                )
                length = self.shorter(length, None)
                continue
            settings = self.prerun_settings(util, length, mu)
            outcome = self.launch(settings)
            if outcome.kind is OutcomeKind.OK:
                fits[length] = outcome
                shortest = min(fails) if fails else None
                target = (
                    None
                    if jumped or shortest is None
                    else self.jump_target(fits, shortest, fails[shortest])
                )
                if target is None:
                    return outcome
                jumped = True
                self.decide(
                    "jump to max_model_len",
                    f"measured peaks at {sorted(fits)} and a failure at {min(fails):,} predict "
                    f"that {target:,} fits",
                    max_model_len=target,
                )
                length = target
                continue
            if outcome.kind is OutcomeKind.DEVICE_REFUSED:
                util = self.lower_util(util, outcome, util_steps)
                continue
            if mu < most and outcome.kind in (
                OutcomeKind.OOM_AT_START,
                OutcomeKind.KV_EXHAUSTED,
                OutcomeKind.OOM_IN_REQUEST,
            ):
                pinned = None
                self.decide(
                    "raise model-use",
                    f"{outcome.kind.value} with model-use {mu} GiB; the most {length:,} tokens "
                    f"allow is {most} GiB (below card*util)",
                    model_use_gib=most,
                )
                continue
            fails[length] = outcome
            if fits:  # a jump that did not hold: the longest length that fitted stands
                best = max(fits)
                self.decide(
                    "keep max_model_len",
                    f"{length:,} failed ({outcome.kind.value}); {best:,} was measured to fit",
                )
                return fits[best]
            self.decide(
                "shorten max_model_len",
                f"{outcome.kind.value} at {length:,} with model-use {mu} GiB, the most this "
                "length allows (raising it further would leave no KV for one sequence)",
            )
            length = self.shorter(length, outcome.estimated_max_len)

    def prerun_settings(
        self, util: float, length: int, model_use: int | None = None
    ) -> LaunchSettings:
        """The method's pre-run: max-num-seqs 1, batched = max_model_len, one long request."""
        cfg = self.cfg
        if model_use is None:
            model_use = prerun_model_use(cfg.card.card_gib, util, length, self.bpt, cfg.block_size)
            if cfg.model_use_gib is not None:
                model_use = min(cfg.model_use_gib, model_use)
        return LaunchSettings(
            purpose=Purpose.PRERUN,
            card_gib=cfg.card.card_gib,
            util=util,
            model_use_gib=model_use,
            max_model_len=length,
            max_num_seqs=1,
            max_num_batched_tokens=length,
            block_size=cfg.block_size,
            tp=self.plan.tp,
            pp=self.plan.pp,
        )

    def shorter(self, length: int, estimated: int | None) -> int:
        cfg = self.cfg
        if length <= cfg.min_model_len:
            raise InfeasibleError(
                f"{cfg.model.name} does not fit TP{self.plan.tp} on {cfg.card.card_gib} GiB "
                f"cards even at --min-model-len {cfg.min_model_len:,} (measured)",
                hint="add cards (--tp), use a quantized checkpoint, or lower --min-model-len",
            )
        lower = [n for n in cfg.len_ladder if n < length]
        nxt = lower[0] if lower else length // 2
        if estimated is not None and cfg.min_model_len <= estimated < length:
            nxt = max(nxt, (estimated // cfg.block_size) * cfg.block_size)
        return max(cfg.min_model_len, nxt)

    def lower_util(self, util: float, outcome: LaunchOutcome, steps: Any) -> float:
        if outcome.device_free_mib:
            reserve = self.cfg.reserve_gib or MEASURED_RESERVE_GIB
            new = floor_to(
                (outcome.device_free_mib * MIB / GIB - reserve) / self.cfg.card.card_gib, 2
            )
            why = f"MindSpore reports {outcome.device_free_mib:,} MiB free"
        else:
            new = next((u for u in steps if u < util), 0.0)
            why = "the device refused the pool size; next step of the method's util ladder"
        if new <= 0 or new >= util:
            raise InfeasibleError(
                f"the card refuses util {util} and no lower util is left to try",
                hint="check `npu-smi info` for other processes on the card",
            )
        self.decide("lower util", why, util=new)
        return new

    def jump_target(
        self, fits: dict[int, LaunchOutcome], fail: int, failed: LaunchOutcome | None
    ) -> int | None:
        """The largest multiple of JUMP_STEP between the longest fit and `fail` that the
        measured weights+activations, fitted against length, say would fit; or None.

        The slope is at least the plan's activation slope and at least the chord to the
        failed length, whose pool dump at the OOM bounds what that length needs from below.
        """
        cfg = self.cfg
        lo = max(fits)
        points = sorted((n, self.weights_act_bytes(o)) for n, o in fits.items())
        lens = np.array([p[0] for p in points], dtype=float)
        was = np.array([p[1] for p in points], dtype=float)
        tp = self.plan.tp
        slope = float(activation_bytes(cfg.model, 2, tp) - activation_bytes(cfg.model, 1, tp))
        if len(points) >= 2:
            slope = max(slope, float(np.polyfit(lens, was, 1)[0]))
        anchor_len, anchor_wa = float(lens[-1]), float(was[-1])
        if failed is not None and failed.worst_peak_mib:
            s = failed.settings
            kv = int(s.card_gib * GIB * s.util) - s.model_use_gib * GIB
            kv = kv_tokens(kv, self.bpt, s.block_size) * self.bpt
            bound = failed.worst_peak_mib * MIB - kv
            slope = max(slope, (bound - anchor_wa) / (fail - anchor_len))
        util = fits[lo].settings.util
        futil, _ = final_util(cfg, fits[lo])
        best = None
        n = (lo // JUMP_STEP + 1) * JUMP_STEP
        while n < fail:
            wa = (anchor_wa + slope * (n - anchor_len)) * (1 + JUMP_MARGIN)
            pre_mu = prerun_model_use(cfg.card.card_gib, util, n, self.bpt, cfg.block_size)
            final_mu = math.ceil(wa / GIB + cfg.headroom_gib)
            kv_final = int(cfg.card.card_gib * GIB * futil) - final_mu * GIB
            if wa <= pre_mu * GIB and kv_tokens(kv_final, self.bpt, cfg.block_size) >= n:
                best = n
            n += JUMP_STEP
        if best is not None and len(points) < 2:
            # One measured point cannot show how fast activations grow (attention can be
            # super-linear); go halfway. A jump that fails costs no extra launch: the measured
            # shorter length stands and the run still ends with one validation.
            best = (lo + (best - lo) // 2) // JUMP_STEP * JUMP_STEP
            best = best if best > lo else None
        return best

    def weights_act_bytes(self, o: LaunchOutcome) -> int:
        s = o.settings
        d = derive(self.prerun_inputs(o, self.cfg.headroom_gib, s.util))
        return d.weights_act_bytes

    def prerun_inputs(self, o: LaunchOutcome, headroom: float, util: float) -> PrerunInputs:
        s = o.settings
        assert o.worst_peak_mib is not None  # noqa: S101 - OK outcomes always carry a peak
        return PrerunInputs(
            card_gib=s.card_gib,
            util=s.util,
            model_use_gib=s.model_use_gib,
            actual_peak_mib=o.worst_peak_mib,
            kv_bytes_per_token=self.bpt,
            block_size=s.block_size,
            max_model_len=s.max_model_len,
            headroom_gib=headroom,
            final_util=util,
            per_seq_bytes=per_sequence_bytes(self.cfg.model.vocab_size),
        )

    def derive(self, prerun: LaunchOutcome, headroom: float) -> tuple[Derivation, str]:
        util, source = final_util(self.cfg, prerun)
        d = derive(self.prerun_inputs(prerun, headroom, util))
        # The integer model-use does not depend on util: give its rounding back through util.
        recovered, why = final_util(self.cfg, prerun, d.rounding_cost_bytes / GIB)
        if recovered > util:
            util, source = recovered, why
            d = derive(self.prerun_inputs(prerun, headroom, util))
        self.decide(
            "derive",
            f"worst-rank peak {prerun.worst_peak_mib:,} MiB -> weights+activations "
            f"{d.weights_act_gib:.2f} GiB; final util {util} from {source}",
            vllm_model_memory_use_gb=d.final.vllm_model_memory_use_gb,
            gpu_memory_utilization=util,
            max_num_seqs=d.final.max_num_seqs,
            kv_gib=round(d.final.kv_bytes / GIB, 3),
        )
        return d, source

    def validate(self, prerun: LaunchOutcome, d: Derivation, source: str) -> TuneResult:
        headroom = self.cfg.headroom_gib
        while True:
            f = d.final
            settings = replace(
                prerun.settings,
                purpose=Purpose.VALIDATE,
                util=f.gpu_memory_utilization,
                model_use_gib=f.vllm_model_memory_use_gb,
                max_num_seqs=f.max_num_seqs,
                max_num_batched_tokens=f.max_num_batched_tokens,
            )
            outcome = self.launch(settings)
            cap_mib = settings.card_gib * settings.util * 1024
            if outcome.kind is OutcomeKind.OK and outcome.requests_ok == outcome.requests_total:
                peak = outcome.worst_peak_mib or 0
                if peak <= cap_mib:
                    self.decide(
                        "validated",
                        f"{outcome.requests_total} concurrent requests of "
                        f"{settings.max_model_len:,} tokens, no OOM, worst-rank peak "
                        f"{peak:,} MiB within card*util = {cap_mib:,.0f} MiB",
                    )
                    return self.result(d, True, source)
            if outcome.kind is OutcomeKind.REQUESTS_FAILED:
                # Requests failed but no OOM was logged: more headroom would not help.
                raise ServerFailedError(
                    f"validation: {outcome.requests_total - outcome.requests_ok} of "
                    f"{outcome.requests_total} requests failed without any OOM in the log "
                    f"({outcome.request_error or 'no error text'})",
                    hint=f"check the server log {outcome.log_path} and --request-timeout",
                    log_path=outcome.log_path,
                )
            headroom += 1.0
            self.decide(
                "raise headroom",
                f"validation failed ({outcome.kind.value}, {outcome.requests_ok}/"
                f"{outcome.requests_total} requests ok); learning: +1 GiB headroom",
                headroom_gib=headroom,
            )
            d, source = self.derive(prerun, headroom)

    def result(self, d: Derivation, validated: bool, source: str) -> TuneResult:
        return TuneResult(
            plan=self.plan,
            derivation=d,
            validated=validated,
            outcomes=tuple(self.state.outcomes),
            decisions=tuple(self.state.decisions),
            final_util_source=source,
        )


def recorded_executor(
    record: RunRecord, ctx: LaunchContext, phase: Phase
) -> Callable[[LaunchSettings], LaunchOutcome]:
    """Run launches for real, journaling each; on --resume, replay the finished ones."""
    done = [LaunchOutcome.from_json(e["outcome"]) for e in record.of_kind("launch")]
    counter = {"n": 0}

    def execute(settings: LaunchSettings) -> LaunchOutcome:
        counter["n"] += 1
        n = counter["n"]
        if n <= len(done) and done[n - 1].settings == settings:
            phase("replay", f"launch {n} finished in the earlier session: {done[n - 1].kind.value}")
            return done[n - 1]
        record.append("launch_started", n=n, settings=settings.to_json())
        outcome = run_launch(n, settings, ctx, record, phase)
        record.append("launch", n=n, outcome=outcome.to_json())
        return outcome

    return execute


def tune(cfg: TuneConfig, record: RunRecord, ctx: LaunchContext, phase: Phase) -> TuneResult:
    """The whole loop against real (or emulated) servers, journaled in `record`."""
    return Tuner(cfg, recorded_executor(record, ctx, phase), phase).run()
