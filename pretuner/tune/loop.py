"""`Tuner.run() -> TuneResult`: the automated pre-run method with fallbacks and validation.

1. plan: pick or check the layout; a layout whose weights cannot fit is refused before launch.
2. pre-run: GLOG_v=1, max-num-seqs 1, one max-length request that must really run.
3. every decision at the memory the final configuration will have: once a launch measured the
   card's free memory, later pre-runs use the largest pool it allows and every fit is judged
   with the final headroom and integer rounding (`pretuner.tune.search.Budget`).
4. fall back by cause; between the longest length that fits and the shortest that does not,
   narrow with the measured peaks (`pretuner.tune.search`) until they are within 1024 tokens;
   when a whole-prompt prefill step is what does not fit, prefill in chunks instead.
5. validate: max-num-seqs concurrent max-length requests. A validation that runs out of memory
   teaches the per-sequence cost from its own pool dump; one that passes with room to spare is
   tightened once with what it measured. Never report an unproven configuration.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pretuner.errors import (
    InfeasibleError,
    NotValidatedError,
    PretunerError,
    ServerFailedError,
)
from pretuner.kvmath import kv_bytes_per_token, num_kv_blocks
from pretuner.method import Derivation, PrerunInputs, derive, per_sequence_bytes
from pretuner.models.spec import ModelSpec
from pretuner.plan import PlanConfig, PlanResult, activation_bytes, plan, smallest_weights_layout
from pretuner.tune import budget as bud
from pretuner.tune.execute import LaunchContext, LaunchOutcome, OutcomeKind, Phase, run_launch
from pretuner.tune.record import RunRecord
from pretuner.tune.search import (
    Bound,
    Budget,
    Measured,
    WaModel,
    kv_blocks_for_one,
    next_length,
)
from pretuner.tune.settings import LaunchSettings, Purpose
from pretuner.units import GIB, MIB

log = logging.getLogger(__name__)

UTIL_LADDER = (0.87, 0.85, 0.8)  # seed 003: lower util when the device refuses
LEN_LADDER = (16384, 8192, 4096)
VLLM_V0_WATERMARK = 0.01  # vLLM 0.6's block manager keeps 1 % of the KV blocks free
DEFAULT_CHUNK_TOKENS = 2048  # vLLM 0.6.6's budget when chunked prefill is on
CHUNK_GRID = 1024  # a larger chunk budget is a multiple of this
TIGHTEN_MIN_GAIN = 0.02  # a validated config is tightened when that buys 2 % more KV
# A tightened configuration keeps this much above what the validation measured under full
# load (a floor plus a share of the activations): small, because it is validated in turn and
# the configuration proven before stands if it fails.
TIGHTEN_MARGIN_FLOOR_BYTES = 8 * MIB
TIGHTEN_MARGIN_SHARE = 0.001
LEARN_MARGIN = 0.10  # a validation OOM's per-sequence cost is inflated by this
CHUNKED_GROWING_SHARE = 0.1  # see WaModel.growing_share


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
    headroom_gib: float | None = None  # base headroom; None: scaled to the measurement
    reserve_gib: float | None = None  # default: scaled to the card (pretuner.tune.budget)
    max_launches: int = 8
    validate: bool = True
    model_use_gib: int | None = None  # pin the pre-run's model-use (the seed's 50); default: max
    len_ladder: tuple[int, ...] = LEN_LADDER  # the backend's lengths to fall back through
    watermark: float = VLLM_V0_WATERMARK
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


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
    prerun: LaunchOutcome | None = None  # the pre-run the derivation rests on
    validation: LaunchOutcome | None = None  # the launch that proved it


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
            headroom_gib=0.5 if cfg.headroom_gib is None else cfg.headroom_gib,
        )
    )


floor_to = bud.floor_to


def prerun_util(cfg: TuneConfig) -> float:
    """The method's 0.9, lowered when the card's free memory cannot give that much."""
    if cfg.card.free_mib is None:
        return cfg.util
    reserve = bud.reserve_gib(cfg.card.card_gib, measured_by_engine=False, given=cfg.reserve_gib)
    cap = floor_to((cfg.card.free_mib * MIB / GIB - reserve) / cfg.card.card_gib, 2)
    return min(cfg.util, cap)


def kv_prerun_bytes(s: LaunchSettings, bpt: int) -> int:
    """The KV cache r0.1 allocated for a launch: whole blocks of card*util - model-use."""
    budget = int(s.card_gib * GIB * s.util) - s.model_use_gib * GIB
    return num_kv_blocks(budget, bpt, s.block_size) * s.block_size * bpt


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
        self.weights_bytes = self.plan.weights_bytes_per_card
        self.free: bud.FreeMemory | None = (
            bud.FreeMemory(cfg.card.free_mib, f"{cfg.card.source} (measured)", False)
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
                self.weights_bytes,
                prior_bytes=activation_bytes(cfg.model, cfg.chunk_tokens, tp),
                growing_share=CHUNKED_GROWING_SHARE,
            ),
        }
        self.fits: dict[bool, dict[int, LaunchOutcome]] = {False: {}, True: {}}
        self.fails: dict[bool, set[int]] = {False: set(), True: set()}
        self.per_seq = per_sequence_bytes(cfg.model.vocab_size)
        self.base_headroom = bud.BASE_HEADROOM_FLOOR_BYTES

    # -- bookkeeping ------------------------------------------------------------------------
    def decide(self, what: str, why: str, **data: Any) -> None:
        entry = {"decision": what, "reason": why, **data}
        self.state.decisions.append(entry)
        if self.on_decision is not None:
            self.on_decision(entry)
        log.info("decision: %s (%s)", what, why)
        self.phase("decide", f"{what}: {why}")

    def launches_left(self) -> int:
        return self.cfg.max_launches - len(self.state.outcomes)

    def launch(self, settings: LaunchSettings) -> LaunchOutcome:
        if self.launches_left() <= 0:
            raise NotValidatedError(
                f"launch budget of {self.cfg.max_launches} used up before a configuration was "
                "validated",
                hint="raise --max-launches, or read the run record's decisions",
            )
        outcome = self.execute(settings)
        self.state.outcomes.append(outcome)
        self.learn_card(outcome)
        return outcome

    def learn_card(self, o: LaunchOutcome) -> None:
        """Keep what a launch measured of the card: free memory and the weights."""
        if o.device_free_mib:
            self.free = bud.FreeMemory(o.device_free_mib, "MindSpore init line (measured)", True)
        if o.weights_gib:
            self.weights_bytes = int(o.weights_gib * GIB)
            for m in self.models.values():
                m.weights_bytes = self.weights_bytes

    # -- memory the final configuration will have -------------------------------------------
    def reserve(self) -> float:
        measured = self.free is not None and self.free.measured_by_engine
        return bud.reserve_gib(
            self.cfg.card.card_gib, measured_by_engine=measured, given=self.cfg.reserve_gib
        )

    def max_util(self, current: float) -> float:
        """The util later pre-runs use: the largest pool the measured free memory allows."""
        if self.free is None or not self.free.measured_by_engine:
            return current
        return min(self.util_cap, bud.max_pool_util(self.cfg.card.card_gib, self.free))

    def budget(self, util: float) -> Budget:
        card = self.cfg.card.card_gib
        if self.free is not None:
            free = self.free.mib * MIB
            pool = int(min(free - bud.hard_margin_gib(card) * GIB, card * self.util_cap * GIB))
            used = int(min(free - self.reserve() * GIB, pool))
        else:
            pool = used = int(card * util * GIB)
        return Budget(
            pool_bytes=pool,
            used_bytes=used,
            kv_bytes_per_token=self.bpt,
            block_size=self.cfg.block_size,
            watermark=self.cfg.watermark,
            headroom_one_seq_bytes=TIGHTEN_MARGIN_FLOOR_BYTES,
            headroom_share=TIGHTEN_MARGIN_SHARE,
            weights_bytes=self.weights_bytes,
        )

    def one_sequence_margin(self, wa_bytes: int | None = None) -> int:
        """Headroom of a configuration that serves one sequence: the pre-run measured exactly
        that load, so only the tightening margin is added."""
        act = max(0, (wa_bytes or 0) - self.weights_bytes)
        return TIGHTEN_MARGIN_FLOOR_BYTES + int(TIGHTEN_MARGIN_SHARE * act)

    def wa_bytes(self, o: LaunchOutcome) -> int:
        """Weights + activations a pre-run measured: worst rank's peak - the KV it allocated."""
        assert o.worst_peak_mib is not None  # noqa: S101 - OK outcomes always carry a peak
        return o.worst_peak_mib * MIB - kv_prerun_bytes(o.settings, self.bpt)

    def oom_bound(self, o: LaunchOutcome) -> int:
        """What an out-of-memory pre-run proves: weights + activations exceed the pool it had
        besides the KV cache, and at least the dump's peak plus the allocation that failed."""
        kv = kv_prerun_bytes(o.settings, self.bpt)
        room = int(o.settings.card_gib * GIB * o.settings.util) - kv
        seen = (o.worst_peak_mib or 0) * MIB - kv + (o.oom_alloc_bytes or 0)
        return max(room + 1, seen)

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
        for note in self.plan.notes:
            self.decide("layout note", note)
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

    # -- pre-runs ---------------------------------------------------------------------------
    def prerun_most(self, util: float, length: int) -> int:
        """The largest integer model-use leaving KV for one sequence beside the watermark."""
        blocks = kv_blocks_for_one(length, self.cfg.block_size, self.cfg.watermark)
        need = (blocks + 1) * self.cfg.block_size * self.bpt
        return math.floor((self.cfg.card.card_gib * util * GIB - need) / GIB)

    def prerun_settings(
        self, util: float, length: int, model_use: int | None = None, chunked: bool = False
    ) -> LaunchSettings:
        """The method's pre-run: max-num-seqs 1, one long request; whole-prompt steps unless
        chunked."""
        cfg = self.cfg
        if model_use is None:
            model_use = self.prerun_most(util, length)
            if cfg.model_use_gib is not None:
                model_use = min(cfg.model_use_gib, model_use)
        return LaunchSettings(
            purpose=Purpose.PRERUN,
            card_gib=cfg.card.card_gib,
            util=util,
            model_use_gib=model_use,
            max_model_len=length,
            max_num_seqs=1,
            max_num_batched_tokens=min(length, cfg.chunk_tokens) if chunked else length,
            block_size=cfg.block_size,
            tp=self.plan.tp,
            pp=self.plan.pp,
            kv_cache_dtype=cfg.kv_cache_dtype,
            chunked_prefill=chunked,
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
            if self.launches_left() <= reserve_for_validation and self.any_fit():
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
                        "so nothing was measured; 1 GiB more KV for one max-length sequence "
                        "beside the engine's block watermark",
                        model_use_gib=mu - 1,
                    )
                    continue
                if k is OutcomeKind.REQUESTS_FAILED:
                    raise ServerFailedError(
                        f"the pre-run's probe failed without any out-of-memory line "
                        f"({o.request_error or 'no error text'})",
                        hint=f"check the server log {o.log_path}",
                        log_path=o.log_path,
                    )
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
                self.why_length(chunked, nxt),
                max_model_len=nxt,
            )
            length = nxt
        return self.finish_search(chunked, util)

    def any_fit(self) -> bool:
        return bool(self.fits[False] or self.fits[True])

    def free_desc(self) -> str:
        if self.free is None:
            return "no free-memory reading"
        return f"{self.free.mib:,} MiB free ({self.free.source})"

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
            "measured, but too long",
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
            self.models[chunked],
            self.budget(self.cfg.util),
            requested=self.cfg.max_model_len,
            longest_fit=lo,
            shortest_fail=hi,
            minimum=self.cfg.min_model_len,
        )

    def why_length(self, chunked: bool, nxt: int) -> str:
        lo, hi = self.bracket(chunked)
        known = []
        if lo is not None:
            known.append(f"{lo:,} fits (measured)")
        if hi is not None:
            known.append(f"{hi:,} does not")
        wa = self.models[chunked].predict(nxt)
        return (
            f"{'; '.join(known) or 'nothing measured yet'}; the measured peaks predict "
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
                f"{length:,} tokens is the longest measured to fit"
                + (f"; {hi:,} did not" if hi else "")
                + f" (asked: {cfg.max_model_len:,})",
                max_model_len=length,
            )
        return best

    def nothing_fits(self, chunked: bool) -> LaunchOutcome:
        cfg = self.cfg
        _, hi = self.bracket(chunked)
        if hi is not None and hi <= cfg.min_model_len:
            raise InfeasibleError(
                f"{cfg.model.name} does not fit TP{self.plan.tp} on {cfg.card.card_gib} GiB "
                f"cards even at --min-model-len {cfg.min_model_len:,} (measured at the card's "
                f"free memory: {self.free_desc()})",
                hint=self.layout_hint("add cards (--tp)")
                + ", use a quantized checkpoint, or lower --min-model-len",
            )
        raise NotValidatedError(
            f"no length from {cfg.min_model_len:,} to {cfg.max_model_len:,} was measured to fit "
            f"within {cfg.max_launches} launches",
            hint="raise --max-launches, or read the run record's decisions",
        )

    def layout_hint(self, default: str) -> str:
        cfg = PlanConfig(
            model=self.cfg.model,
            card_gib=self.cfg.card.card_gib,
            util=self.cfg.util,
            max_model_len=self.cfg.min_model_len,
            pp=self.cfg.pp,
            kv_cache_dtype=self.cfg.kv_cache_dtype,
            block_size=self.cfg.block_size,
            weights_format=self.cfg.weights_format,
        )
        tp = smallest_weights_layout(cfg)
        if tp is not None and tp > self.plan.tp:
            return f"use --tp {tp} or more"
        return default

    def weights_do_not_fit(self, o: LaunchOutcome) -> None:
        cfg = self.cfg
        raise InfeasibleError(
            f"TP{self.plan.tp} x PP{self.plan.pp}: the weights of {cfg.model.name} did not fit "
            f"on a {cfg.card.card_gib} GiB card: out of memory before they finished loading "
            f"({o.oom_text or 'see the log'}; measured, log {o.log_path})",
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
            f"GiB and whole {length:,}-token steps do not; the measured peaks predict "
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

    def lower_util(self, util: float, outcome: LaunchOutcome, steps: Any) -> float:
        if outcome.device_free_mib:
            free = bud.FreeMemory(outcome.device_free_mib, "the device's refusal (measured)", True)
            self.free = free
            new = bud.max_pool_util(self.cfg.card.card_gib, free)
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

    # -- derivation -------------------------------------------------------------------------
    def prerun_inputs(
        self, o: LaunchOutcome, util: float, per_seq: int, base: int
    ) -> PrerunInputs:
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
            headroom_gib=base / GIB,
            max_num_batched_tokens=s.max_num_batched_tokens,
            final_util=util,
            per_seq_bytes=per_seq,
            watermark=self.cfg.watermark,
        )

    def derive(
        self,
        prerun: LaunchOutcome,
        per_seq: int | None = None,
        base: int | None = None,
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
            f"{prerun.settings.max_model_len:,} tokens fits; the pre-run measured exactly one "
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
            util = min(self.util_cap, bud.pool_util(card, self.free, reserve, rounding / GIB))
            d = derive(self.prerun_inputs(prerun, util, per_seq, base))
            source = f"{self.free.source}: {self.free.mib:,} MiB free - {reserve:.3g} GiB reserve"
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
            vllm_model_memory_use_gb=d.final.vllm_model_memory_use_gb,
            gpu_memory_utilization=util,
            max_num_seqs=d.final.max_num_seqs,
            kv_gib=round(d.final.kv_bytes / GIB, 3),
        )
        return d, source

    # -- validation -------------------------------------------------------------------------
    def final_settings(self, prerun: LaunchOutcome, d: Derivation) -> LaunchSettings:
        f = d.final
        return replace(
            prerun.settings,
            purpose=Purpose.VALIDATE,
            util=f.gpu_memory_utilization,
            model_use_gib=f.vllm_model_memory_use_gb,
            max_num_seqs=f.max_num_seqs,
            max_num_batched_tokens=f.max_num_batched_tokens,
        )

    def validate(self, prerun: LaunchOutcome, d: Derivation, source: str) -> TuneResult:
        proven: tuple[Derivation, str, LaunchOutcome] | None = None
        tightened = False
        per_seq = self.per_seq
        while True:
            settings = self.final_settings(prerun, d)
            if proven is not None and self.launches_left() <= 0:
                break
            outcome = self.launch(settings)
            cap_mib = settings.card_gib * settings.util * 1024
            peak = outcome.worst_peak_mib or 0
            if (
                outcome.kind is OutcomeKind.OK
                and outcome.requests_ok == outcome.requests_total
                and peak <= cap_mib
            ):
                self.decide(
                    "validated",
                    f"{outcome.requests_total} concurrent requests of "
                    f"{settings.max_model_len:,} tokens, no OOM, worst-rank peak "
                    f"{peak:,} MiB within card*util = {cap_mib:,.0f} MiB",
                )
                proven = (d, source, outcome)
                if tightened:
                    break
                tightened = True
                tighter = self.tighten(prerun, d, outcome)
                if tighter is None:
                    break
                d, source = tighter
                continue
            if proven is not None:
                self.decide(
                    "keep the validated configuration",
                    f"the tightened one failed ({outcome.kind.value}); the one proven before "
                    "stands",
                )
                break
            if outcome.kind is OutcomeKind.DEVICE_REFUSED:
                self.lower_util(settings.util, outcome, iter(UTIL_LADDER))
                d, source = self.derive(prerun, per_seq=per_seq)
                continue
            if outcome.kind is OutcomeKind.REQUESTS_FAILED:
                # Requests failed but no OOM was logged: more headroom would not help.
                raise ServerFailedError(
                    f"validation: {outcome.requests_total - outcome.requests_ok} of "
                    f"{outcome.requests_total} requests failed without any OOM in the log "
                    f"({outcome.request_error or 'no error text'})",
                    hint=f"check the server log {outcome.log_path} and --request-timeout",
                    log_path=outcome.log_path,
                )
            prerun, d, source, per_seq = self.learn(prerun, d, outcome, per_seq)
        assert proven is not None  # noqa: S101 - the loop leaves only with a proven config
        d, source, outcome = proven
        return self.result(d, True, source, prerun, outcome)

    def full_load_non_kv(self, o: LaunchOutcome) -> int:
        """What a validation's worst rank held besides the KV cache (its pool dump), plus the
        allocation that failed when it ran out."""
        kv = kv_prerun_bytes(o.settings, self.bpt)
        return (o.worst_peak_mib or 0) * MIB - kv + (o.oom_alloc_bytes or 0)

    def tighten(
        self, prerun: LaunchOutcome, d: Derivation, val: LaunchOutcome
    ) -> tuple[Derivation, str] | None:
        """A configuration with more KV, from what the passed validation measured under full
        load; None when that buys less than TIGHTEN_MIN_GAIN or no launch is left."""
        if self.launches_left() <= 0 or self.cfg.headroom_gib is not None:
            return None
        wa = d.weights_act_bytes
        seqs = val.settings.max_num_seqs
        full = self.full_load_non_kv(val)
        # Measured: `full` at `seqs` sequences. Each sequence more costs the slope between the
        # pre-run (one) and the validation, or the model's per-sequence figure.
        slope = max(0, (full - wa) // (seqs - 1)) if seqs > 1 else self.per_seq
        slope = int(slope * 1.02)
        margin = TIGHTEN_MARGIN_FLOOR_BYTES + int(
            TIGHTEN_MARGIN_SHARE * max(0, full - self.weights_bytes)
        )
        # derive() adds base + slope x (sequences - 1): at `seqs` that is full - wa + margin.
        base = max(0, full - wa + margin - slope * (seqs - 1))
        try:
            cand, source = self.derive(prerun, per_seq=slope, base=base, announce=False)
        except PretunerError:
            return None
        gain = cand.final.kv_bytes - d.final.kv_bytes
        if gain < TIGHTEN_MIN_GAIN * d.final.kv_bytes and (
            cand.final.max_num_seqs <= d.final.max_num_seqs
        ):
            self.decide(
                "no tightening",
                f"under full load the worst rank held {full / GIB:.2f} GiB besides the KV cache; "
                f"a tighter budget would add {gain / GIB:.2f} GiB of KV, under "
                f"{TIGHTEN_MIN_GAIN:.0%}",
            )
            return None
        self.decide(
            "tighten",
            f"under full load ({seqs} sequences) the worst rank held {full / GIB:.2f} GiB besides "
            f"the KV cache (measured: {(full - wa) / MIB:,.0f} MiB above the pre-run); with that "
            f"and a {margin / MIB:,.0f} MiB margin the KV cache grows by {gain / GIB:.2f} GiB to "
            f"{cand.final.max_num_seqs} sequences: validating it",
            vllm_model_memory_use_gb=cand.final.vllm_model_memory_use_gb,
            max_num_seqs=cand.final.max_num_seqs,
        )
        return cand, source

    def learn(
        self, prerun: LaunchOutcome, d: Derivation, val: LaunchOutcome, per_seq: int
    ) -> tuple[LaunchOutcome, Derivation, str, int]:
        """Re-derive from a validation that ran out of memory: its own dump says what the full
        load needed; shrink what caused it."""
        seqs = val.settings.max_num_seqs
        need = self.full_load_non_kv(val)
        wa = d.weights_act_bytes
        before = per_seq
        if seqs > 1:
            per_seq = max(
                per_seq,
                int((need - wa - self.base_headroom) / (seqs - 1) * (1 + LEARN_MARGIN)),
            )
            cause = (
                f"per-sequence headroom {before / MIB:.1f} -> {per_seq / MIB:.1f} MiB"
            )
        else:
            self.base_headroom += int(max(0, need - wa - self.base_headroom - per_seq)
                                      * (1 + LEARN_MARGIN)) + bud.BASE_HEADROOM_FLOOR_BYTES
            cause = f"base headroom -> {self.base_headroom / MIB:,.0f} MiB"
        why = (
            f"validation ran out of memory ({val.kind.value}, {val.oom_text or 'no text'}); its "
            f"pool dump says the worst rank needed at least {need / GIB:.2f} GiB besides the KV "
            f"cache with {seqs} sequences (pre-run: {wa / GIB:.2f} GiB): {cause}"
        )
        try:
            new, source = self.derive(prerun, per_seq=per_seq)
        except InfeasibleError:
            shorter = [n for n in self.fits[prerun.settings.chunked_prefill]
                       if n < prerun.settings.max_model_len]
            if not shorter:
                raise NotValidatedError(
                    f"validation at {prerun.settings.max_model_len:,} tokens ran out of memory "
                    "and no shorter length was measured to fit",
                    hint="pass a shorter --max-model-len",
                ) from None
            prerun = self.fits[prerun.settings.chunked_prefill][max(shorter)]
            self.decide("learn from the validation", why + "; one sequence no longer fits: "
                        f"max_model_len -> {prerun.settings.max_model_len:,}")
            new, source = self.derive(prerun, per_seq=per_seq)
            return prerun, new, source, per_seq
        self.decide(
            "learn from the validation",
            why + f"; max-num-seqs {seqs} -> {new.final.max_num_seqs}, model-use "
            f"{d.final.vllm_model_memory_use_gb} -> {new.final.vllm_model_memory_use_gb} GiB",
            max_num_seqs=new.final.max_num_seqs,
        )
        return prerun, new, source, per_seq

    def result(
        self,
        d: Derivation,
        validated: bool,
        source: str,
        prerun: LaunchOutcome | None,
        validation: LaunchOutcome | None,
    ) -> TuneResult:
        return TuneResult(
            plan=self.plan,
            derivation=d,
            validated=validated,
            outcomes=tuple(self.state.outcomes),
            decisions=tuple(self.state.decisions),
            final_util_source=source,
            prerun=prerun,
            validation=validation,
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
