"""`V1Tuner.run() -> V1Result`: the pre-run method for V1 engines (vLLM, vllm-ascend,
vLLM-MindSpore >= 0.3), which pin their KV cache with `--kv-cache-memory-bytes`.

1. pre-run with the production shape at a safe util, letting the engine profile (or pinning
   one max-length sequence where its profiling cannot see the card), sampling the device;
2. derive the pinned KV from the measured peak (`pretuner.pinned`), or pin the engine's own
   profiled KV, said loudly, when no device reader sampled;
3. validate, worst case first; an OOM backs off by the allocation it names plus the margin;
4. settle on the validation's own peak: widen once when it left room, hold back what a soak
   was still growing (`pretuner.tune.pinned.soak`). Never report an unproven value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pretuner import kvmath, noise
from pretuner.engines.base import LaunchSettings, Phase, Purpose
from pretuner.engines.outcome import Executor, LaunchOutcome, OutcomeKind
from pretuner.errors import InfeasibleError, NotValidatedError, ServerFailedError
from pretuner.models.spec import ModelSpec
from pretuner.pinned import (
    PinnedBudget,
    back_off_bytes,
    derive_pinned,
    kv_held_bytes,
    margin_mib,
    tighten_margin_mib,
)
from pretuner.tune.pinned.soak import soak_figures
from pretuner.tune.setup import TIGHTEN_MIN_GAIN, Method, OnDecision
from pretuner.units import GIB, MIB

# A shared card may leave little: the field note served a 70B model from 7 GB of a 32 GB card.
MIN_PRERUN_UTIL = 0.05
MAX_PRERUNS = 3
# How far the engine's own KV figure may be from the pinned bytes and still be the same pool:
# vLLM prints it rounded to 2 decimals of a GiB on a GPU (`reserved 59.0 GiB`) and to 1 on the
# CPU (`Explicitly set (1.0/11.96) GiB`): half the coarser printed step is 0.05 GiB = 51.2 MiB,
# rounded up to a whole MiB (a figure from the token count, floored to whole blocks, is closer).
PIN_TOLERANCE_MIB = 52
_START_FAILURES = frozenset({OutcomeKind.OOM_AT_START, OutcomeKind.KV_EXHAUSTED,
                             OutcomeKind.DEVICE_REFUSED, OutcomeKind.LEN_TOO_LARGE,
                             OutcomeKind.OOM_WEIGHTS})


def pin_disagreement(kv_bytes: int | None, engine_kv_gib: float | None,
                     device_peak_mib: int | None, reader: str | None) -> str | None:
    """Why a launch did not run with the KV pretuner pinned, or None when it did (or nothing was
    pinned). The engine's own log must report that pool, and the device must have held it: a
    pool the engine sized some other way (a flag pretuner cannot see, smuggled in by a wrapper
    or a config) would make the proof one of another configuration."""
    if kv_bytes is None:
        return None
    pinned = f"pretuner pinned {kv_bytes / GIB:.2f} GiB (--kv-cache-memory-bytes {kv_bytes})"
    if engine_kv_gib is not None and abs(engine_kv_gib * GIB - kv_bytes) > PIN_TOLERANCE_MIB * MIB:
        return (f"{pinned} but the engine's log reports a KV cache of {engine_kv_gib:.2f} GiB "
                f"(more than the {PIN_TOLERANCE_MIB} MiB its rounding explains)")
    if device_peak_mib is not None and device_peak_mib < kv_bytes / MIB:
        return (f"{pinned} = {kv_bytes / MIB:,.0f} MiB but the device's peak was "
                f"{device_peak_mib:,} MiB ({reader}, all of the launch): it never held that pool")
    return None


@dataclass(frozen=True, slots=True)
class V1Config:
    model: ModelSpec
    card_gib: int  # the device size asked for (the sampled total wins once measured)
    bytes_per_token: int  # KV bytes per token per device
    util: float = 0.9  # the pre-run's --gpu-memory-utilization
    max_model_len: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    tp: int = 1
    pp: int = 1
    kv_cache_dtype: str = "auto"
    max_launches: int = 8
    validate: bool = True
    profile_prerun: bool = True  # False: the pre-run pins one sequence's KV instead
    repeat_proof: int = 1  # boots the final configuration is proven on (--repeat-proof)


@dataclass(frozen=True, slots=True)
class V1Result:
    final: LaunchSettings  # what production runs with (kv_cache_bytes pinned)
    validated: bool
    budget: PinnedBudget | None  # None: measured from the logs only
    measured_by: str  # the device reader, or "log" (the engine's own profiling)
    profiled_kv_tokens: int | None  # what the engine's own profiling gave at the pre-run util
    profiled_util: float | None  # that pre-run's util (lowered when 0.9 did not start)
    kv_tokens: int | None  # the final configuration's KV tokens (its log, else derived)
    outcomes: tuple[LaunchOutcome, ...]
    decisions: tuple[dict[str, Any], ...] = field(default=())
    boot_peaks_mib: tuple[int, ...] = ()  # the final configuration's proof peak on each boot


def _how(o: LaunchOutcome) -> str:
    return "simulated" if o.device_reader == "emulated" else "measured"


def _ended(o: LaunchOutcome, what: str) -> ServerFailedError:
    return ServerFailedError(
        f"the {what} ended {o.kind.value}: {o.request_error or o.oom_text or 'see its log'}",
        hint=f"log {o.log_path}", log_path=o.log_path)


class V1Tuner(Method):
    """Pre-run, derive the pinned KV from the measured peak, validate, back off on OOM."""

    why_key = "detail"

    def __init__(self, cfg: V1Config, execute: Executor, phase: Phase,
                 on_decision: OnDecision = None) -> None:
        super().__init__(execute, phase, on_decision, cfg.max_launches)
        self.cfg = cfg
        self.start_util = cfg.util  # lowered only when the device refused util x total
        self.widened = False  # the proven KV is widened once at most
        self.spread = 0  # MiB: the boot-to-boot spread of the proof peaks measured so far
        # The least KV that admits one max-length sequence: whole blocks, one spare.
        self.one_seq = kvmath.kv_bytes_for_tokens(cfg.max_model_len + cfg.block_size,
                                                  cfg.bytes_per_token, cfg.block_size)
        # What the pre-run gave: the derived budget, what measured it, the engine's own profile.
        self.budget: PinnedBudget | None = None
        self.measured_by = "log"
        self.profiled: int | None = None
        self.profiled_util: float | None = None

    def settings(self, purpose: Purpose, util: float, kv_bytes: int | None) -> LaunchSettings:
        c = self.cfg
        return LaunchSettings(
            purpose=purpose, card_gib=c.card_gib, util=round(util, 4), model_use_gib=0,
            max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, block_size=c.block_size, tp=c.tp,
            pp=c.pp, kv_cache_dtype=c.kv_cache_dtype, chunked_prefill=True,
            kv_cache_bytes=kv_bytes,
        )

    def launch(self, settings: LaunchSettings) -> LaunchOutcome:
        """One launch, which must have run with the KV it was given (`pin_disagreement`)."""
        o = super().launch(settings)
        # The device can only be asked to have held a pool the engine served with: one that
        # died while starting (a budget refusing the allocation) never held it, by design.
        served = o.kind not in _START_FAILURES and (o.kv_gib is not None or o.kv_tokens is not None)
        peak = max(o.device_peaks_mib.values(), default=None) if served else None
        why = pin_disagreement(settings.kv_cache_bytes, o.kv_gib, peak, o.device_reader)
        if why is not None:
            raise ServerFailedError(
                f"launch {o.n}: the engine did not take the pinned KV cache: {why}",
                hint="remove the other KV cache setting from the server command, its wrapper "
                f"(--serve-cmd) or its config, then run again; log {o.log_path}",
                log_path=o.log_path)
        return o

    # -- the method ---------------------------------------------------------------------

    def run(self) -> V1Result:
        c = self.cfg
        pre = self.prerun()
        self.budget, self.measured_by, kv_bytes = self.derive(pre)
        self.profiled = pre.kv_tokens if pre.settings.kv_cache_bytes is None else None
        self.profiled_util = pre.settings.util if self.profiled is not None else None
        # vLLM checks util x total against the free memory at start-up even when the KV cache
        # is pinned: a busy card's lower util stays.
        final = self.settings(Purpose.VALIDATE, self.start_util, kv_bytes)
        if not c.validate:
            self.decide("skip validation", "--no-validate: the configuration is NOT proven")
            return self.result(final, False, None)
        r = self.repeat(self.validate(final))
        return replace(r, outcomes=tuple(self.outcomes), decisions=tuple(self.decisions))

    def first_launch(self) -> LaunchSettings:
        """The first pre-run: the engine profiles at util, or one sequence's KV is pinned."""
        kv = None if self.cfg.profile_prerun else self.one_seq
        return self.settings(Purpose.PRERUN, self.cfg.util, kv)

    def prerun(self) -> LaunchOutcome:
        """The first launch that measured the production shape."""
        c = self.cfg
        s = self.first_launch()
        if s.kv_cache_bytes is not None:
            self.decide("pin one sequence",
                        f"{c.model.name} on this engine: the pre-run pins "
                        f"{s.kv_cache_bytes / MIB:.2f} MiB of KV (one {c.max_model_len:,}-token "
                        "sequence) instead of profiling at a util", kv_cache_bytes=s.kv_cache_bytes)
        for _ in range(MAX_PRERUNS):
            o = self.launch(s)
            if o.kind is OutcomeKind.OK:
                return o
            s = self.next_prerun(s, o)
        raise NotValidatedError(
            f"{MAX_PRERUNS} pre-runs did not start and serve one max-length request",
            hint="read the run's report.md: each launch's log says why",
        )

    def next_prerun(self, s: LaunchSettings, o: LaunchOutcome) -> LaunchSettings:
        c = self.cfg
        total = self.total_mib(o)
        if o.kind is OutcomeKind.OOM_WEIGHTS:
            raise InfeasibleError(
                f"TP{c.tp} x PP{c.pp}: {c.model.name}'s weights did not fit on the device "
                f"(the OOM came before the weights finished loading: {o.oom_text})",
                hint="use a larger --tp, a quantized checkpoint, or larger cards",
            )
        short = o.kind.is_oom or o.kind in (OutcomeKind.LEN_TOO_LARGE, OutcomeKind.KV_EXHAUSTED)
        if s.kv_cache_bytes is None and short:
            # The non-KV peak does not depend on the KV size: measure it with the least KV
            # that still runs a max-length request, whatever the engine's profiling missed.
            why = (f"ran out of memory ({o.oom_text})" if o.kind.is_oom else
                   f"left less KV than one {c.max_model_len:,}-token sequence needs")
            self.decide("pin one sequence",
                        f"the pre-run at util {s.util:g} {why}; pre-run again with "
                        f"{self.one_seq / GIB:.2f} GiB pinned (one max-length sequence)",
                        kv_cache_bytes=self.one_seq)
            return replace(s, kv_cache_bytes=self.one_seq)
        if o.kind is OutcomeKind.DEVICE_REFUSED and o.device_free_mib and s.kv_cache_bytes is None:
            util = round(max(MIN_PRERUN_UTIL, (o.device_free_mib - margin_mib(total)) / total), 4)
            self.start_util = util
            self.decide("lower pre-run util",
                        f"the device has {o.device_free_mib:,} MiB free ({_how(o)}, the engine "
                        f"says); util {s.util:g} asked more", util=util)
            return replace(s, util=util)
        if short:
            estimate = next((x.estimated_max_len for x in self.outcomes if x.estimated_max_len),
                            None)
            shorter = (f"--max-model-len {estimate:,} or less (the engine's own estimate)"
                       if estimate else "a shorter --max-model-len")
            raise InfeasibleError(
                f"max_model_len {c.max_model_len:,} does not fit: a pre-run with only one "
                f"sequence's KV ({self.one_seq / GIB:.2f} GiB) pinned ended {o.kind.value}"
                + (f" ({o.oom_text})" if o.oom_text else ""),
                hint=f"use {shorter}, a larger --tp, or larger cards",
            )
        raise _ended(o, "pre-run")

    def total_mib(self, o: LaunchOutcome) -> int:
        return o.device_total_mib or self.cfg.card_gib * 1024

    def derive(self, pre: LaunchOutcome) -> tuple[PinnedBudget | None, str, int]:
        c = self.cfg
        held = kv_held_bytes(pre.kv_tokens, c.bytes_per_token, pre.kv_gib)
        peak = max(pre.device_peaks_mib.values(), default=None)
        if held is None:
            raise ServerFailedError(
                "the pre-run's log does not say how much KV cache it held",
                hint=f"check the engine's log {pre.log_path} (a `KV cache size` line)",
                log_path=pre.log_path,
            )
        if pre.compile_cache == "cold" and pre.settings.kv_cache_bytes is None:
            self.decide("cold compile cache",
                        "the pre-run profiled with a cold compile cache: the engine compiled at "
                        "start-up, which can shrink the KV pool it profiles (vLLM issues 54383, "
                        "54122): a KV pinned from that profile alone may be low, and the "
                        "engine's profile figure in the report with it")
        if peak is None or pre.device_total_mib is None:
            kv = held // MIB * MIB
            self.decide("log only",
                        "no device memory was sampled: pinning what the engine's own profiling "
                        f"gave ({kv / GIB:.2f} GiB), not more (install the NVML extra to measure)",
                        kv_cache_bytes=kv)
            return None, "log", kv
        budget = derive_pinned(pre.device_total_mib, peak, held, pre.device_reader or "device")
        self.decide("derive", "; ".join(budget.lines()), kv_cache_bytes=budget.kv_bytes,
                    non_kv_mib=round(budget.non_kv_mib, 1), margin_mib=budget.margin_mib)
        self.check_one_sequence(budget.kv_bytes, "the measured peak leaves")
        return budget, pre.device_reader or "device", budget.kv_bytes

    def check_one_sequence(self, kv_bytes: int, why: str) -> None:
        c = self.cfg
        if kv_bytes >= self.one_seq:
            return
        tokens = kvmath.kv_tokens(kv_bytes, c.bytes_per_token, c.block_size)
        raise InfeasibleError(
            f"max_model_len {c.max_model_len:,} does not fit: {why} {kv_bytes / GIB:.2f} GiB of "
            f"KV ({tokens:,} tokens), less than one sequence needs ({self.one_seq / GIB:.2f} GiB)",
            hint=f"use --max-model-len {max(0, tokens - c.block_size):,} or less, a larger "
            "--tp, or larger cards",
        )

    def validate(self, s: LaunchSettings) -> V1Result:
        while True:
            o = self.launch(s)
            if o.kind is OutcomeKind.OK:
                self.decide("validated", self.proven(s, o))
                proven = self.result(s, True, o.kv_tokens)
                return self.tighten(s, o, proven)
            if not o.kind.is_oom:
                raise _ended(o, "validation")
            s = self.back_off(s, o, f"{o.kind.value} at {(s.kv_cache_bytes or 0) / GIB:.2f} GiB "
                              "pinned")

    def back_off(self, s: LaunchSettings, o: LaunchOutcome, what: str) -> LaunchSettings:
        """`s` with the next pinned KV after the OOM of `o`; the decision says `what` ran out and
        why that much."""
        kv_now = s.kv_cache_bytes or 0
        total = self.total_mib(o)
        alloc = o.oom_alloc_bytes
        peak = max(o.device_peaks_mib.values(), default=None)
        kv, how = back_off_bytes(kv_now, alloc, total), "less by that allocation and the margin"
        if alloc is not None and 2 * alloc >= kv_now and peak is not None:
            # The KV cache itself was refused: nothing of it was held when the launch's peak
            # was sampled, so that peak is all non-KV (this launch's own, not the pre-run's).
            budget = derive_pinned(total, peak, 0, o.device_reader or "device")
            kv = min(budget.kv_bytes, back_off_bytes(kv_now, 0, total))
            how = (f"the KV cache itself was refused; derived again from this launch's peak: "
                   f"{budget.lines()[1]}")
        self.decide("back off", f"{what} ({o.oom_text or 'no allocation named'}); {how}: "
                    f"{kv / GIB:.2f} GiB", kv_cache_bytes=kv)
        self.check_one_sequence(kv, "backing off leaves")
        return replace(s, kv_cache_bytes=kv)

    def proven(self, s: LaunchSettings, o: LaunchOutcome) -> str:
        kv = s.kv_cache_bytes or 0
        peak = (f", device peak {max(o.device_peaks_mib.values()):,} of "
                f"{o.device_total_mib:,} MiB ({_how(o)})"
                if o.device_peaks_mib and o.device_total_mib else "")
        what = (f"{o.requests_ok} requests served (the worst case, {o.soak_requests} soak "
                "requests, the worst case again)" if o.soak_requests else
                f"{o.requests_ok} requests served (max-length ones of {s.max_model_len:,} "
                "tokens, then a burst of short ones as wide as max-num-seqs)")
        return f"--kv-cache-memory-bytes {kv} ({kv / GIB:.2f} GiB): {what}, no OOM{peak}"

    def tighten(self, s: LaunchSettings, o: LaunchOutcome, proven: V1Result) -> V1Result:
        """Widen the KV once by what the validation's peak left unused beyond the headroom it
        keeps (the boot-noise floor, the soak's growth, a thin margin), or lower it where the
        peak left less than that headroom; proven in turn, else the proven stands."""
        if not o.device_peaks_mib or o.device_total_mib is None or s.kv_cache_bytes is None:
            return proven
        total = o.device_total_mib
        peak = max(o.device_peaks_mib.values())
        soak = soak_figures(o)
        hold = soak.held_back_mib if soak is not None else 0
        keep = noise.floor_mib(total, self.spread)
        margin = tighten_margin_mib(total)
        short = keep + hold - (total - peak)
        if short > 0:
            return self.hold_back(s, o, proven, short, hold)
        spare_mib = -short - margin
        if spare_mib * MIB < TIGHTEN_MIN_GAIN * s.kv_cache_bytes or self.widened \
                or self.launches_left() <= 0:
            return proven
        self.widened = True
        wider = replace(s, kv_cache_bytes=s.kv_cache_bytes + spare_mib * MIB)
        self.decide("tighten",
                    f"the validation's peak left {total - peak:,} MiB of {total:,} MiB unused; "
                    f"try {spare_mib:,} MiB more KV (keeping "
                    f"{noise.floor_words(total, self.spread)} and {margin} MiB"
                    + (f" and {hold:,} MiB for more growth, twice the soak's second half"
                       if hold else "")
                    + "), proven in turn", kv_cache_bytes=wider.kv_cache_bytes)
        t = self.launch(wider)
        if t.kind is not OutcomeKind.OK:
            self.decide("keep the proven",
                        f"the tightened KV ended {t.kind.value}; the configuration proven before "
                        "stands")
            return replace(proven, outcomes=tuple(self.outcomes),
                           decisions=tuple(self.decisions))
        self.decide("validated", self.proven(wider, t))
        # Its own soak may still ask for headroom.
        return self.tighten(wider, t, self.result(wider, True, t.kv_tokens))

    def hold_back(self, s: LaunchSettings, o: LaunchOutcome, proven: V1Result, short_mib: int,
                  hold_mib: int) -> V1Result:
        """The peak left `short_mib` less than the headroom kept (the boot-noise floor and the
        soak's growth): lower the KV by that and prove it again (while launches remain)."""
        total = o.device_total_mib or 0
        peak = max(o.device_peaks_mib.values())
        growth = (f" and {hold_mib:,} MiB held back for growth (the soak was still growing: "
                  "twice its second half's growth)" if hold_mib else "")
        why = (f"the proof's peak {peak:,} of {total:,} MiB ({_how(o)}) leaves "
               f"{total - peak:,} MiB, {short_mib:,} MiB less than "
               f"{noise.floor_words(total, self.spread)}{growth}")
        if self.launches_left() <= 0:
            self.decide("headroom short", f"{why}; no launch left (--max-launches "
                        f"{self.cfg.max_launches}): the configuration proven stands with "
                        f"{short_mib:,} MiB less headroom than it should keep")
            return proven
        # Lowered by the shortfall and the thin margin once more: the next proof measures its
        # peak (and any soak's growth) anew, and a proof a few MiB short again would creep.
        cut_mib = short_mib + tighten_margin_mib(total)
        lower = replace(s, kv_cache_bytes=(s.kv_cache_bytes or 0) - cut_mib * MIB)
        self.decide("hold back", f"{why}: KV lowered by that and the margin, {cut_mib:,} MiB, "
                    f"to {(lower.kv_cache_bytes or 0) / GIB:.2f} GiB, proven in turn",
                    kv_cache_bytes=lower.kv_cache_bytes, held_back_mib=hold_mib)
        self.check_one_sequence(lower.kv_cache_bytes or 0, "holding the headroom back leaves")
        return self.validate(lower)

    def repeat(self, r: V1Result) -> V1Result:
        """Prove the final configuration on --repeat-proof boots in all; its headroom keeps at
        least their spread (else lowered by the difference and proven again)."""
        while r.validated and self.cfg.repeat_proof > 1:
            first = next(o for o in reversed(self.outcomes)
                         if o.settings == r.final and o.kind is OutcomeKind.OK)
            if not first.device_peaks_mib or first.device_total_mib is None:
                self.decide("repeat proof", "no device memory was sampled: no boot spread")
                return r
            total = first.device_total_mib
            boots = [first]
            while len(boots) < self.cfg.repeat_proof and self.launches_left() > 0:
                o = self.launch(r.final)
                if not o.kind.is_oom and o.kind is not OutcomeKind.OK:
                    raise _ended(o, f"repeated proof (boot {len(boots) + 1})")
                boots.append(o)
                if o.kind.is_oom:
                    break
            if boots[-1].kind.is_oom:  # one boot of N did not hold it: as a validation OOM
                failed = boots[-1]
                r = self.validate(self.back_off(r.final, failed, f"boot {len(boots)} of the "
                                                f"proven configuration ended {failed.kind.value}"))
                continue
            peaks = tuple(max(o.device_peaks_mib.values(), default=0) for o in boots)
            self.spread = max(self.spread, noise.spread_mib(peaks))
            r = replace(r, boot_peaks_mib=peaks)
            short = noise.short_mib(total, max(peaks), self.spread)
            self.decide("boot spread",
                        f"{len(peaks)} boots of the proven configuration peaked at "
                        + ", ".join(f"{p:,}" for p in peaks) + f" MiB ({_how(first)}): spread "
                        f"{noise.spread_mib(peaks):,} MiB; the headroom kept, "
                        f"{total - max(peaks):,} MiB, must be at least "
                        f"{noise.floor_words(total, self.spread)}"
                        + (f" ({len(peaks)} of {self.cfg.repeat_proof} boots: --max-launches "
                           f"{self.cfg.max_launches} used up)"
                           if len(peaks) < self.cfg.repeat_proof else ""),
                        boot_peaks_mib=list(peaks), spread_mib=noise.spread_mib(peaks))
            if short == 0:
                return r
            worst = boots[max(range(len(peaks)), key=peaks.__getitem__)]
            lowered = self.hold_back(r.final, worst, r, short, 0)
            if lowered is r:
                return r
            r = lowered
        return r

    def result(self, s: LaunchSettings, validated: bool, kv_tokens: int | None) -> V1Result:
        c = self.cfg
        tokens = kv_tokens if kv_tokens is not None else kvmath.kv_tokens(
            s.kv_cache_bytes or 0, c.bytes_per_token, c.block_size)
        return V1Result(s, validated, self.budget, self.measured_by, self.profiled,
                        self.profiled_util, tokens, tuple(self.outcomes), tuple(self.decisions))
