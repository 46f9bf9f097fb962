"""`Validation`: max-num-seqs concurrent max-length requests; learn from a validation that ran
out of memory, tighten one that passed with room to spare, never report an unproven one."""

from __future__ import annotations

from dataclasses import replace

from pretuner import noise
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.errors import (
    InfeasibleError,
    NotValidatedError,
    PretunerError,
)
from pretuner.method import Derivation
from pretuner.tune.busy import crash_error
from pretuner.tune.r01 import budget as bud
from pretuner.tune.r01.config import LEARN_MARGIN, UTIL_LADDER, TuneResult
from pretuner.tune.r01.core import TunerCore
from pretuner.tune.setup import TIGHTEN_MIN_GAIN
from pretuner.units import GIB, MIB


class Validation(TunerCore):

    def final_settings(self, prerun: LaunchOutcome, d: Derivation) -> LaunchSettings:
        f = d.final
        return replace(
            prerun.settings, purpose=Purpose.VALIDATE, util=f.gpu_memory_utilization,
            model_use_gib=f.vllm_model_memory_use_gb, max_num_seqs=f.max_num_seqs,
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
                    f"{outcome.requests_total} requests: {settings.max_num_seqs} concurrent "
                    f"ones of {settings.max_model_len:,} tokens, then a burst of short ones "
                    "as wide as max-num-seqs, no OOM, worst-rank peak "
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
                failed = outcome.requests_total - outcome.requests_ok
                raise crash_error(
                    outcome, f"validation ({failed} of {outcome.requests_total} requests failed)"
                )
            prerun, d, source, per_seq = self.learn(prerun, d, outcome, per_seq)
        assert proven is not None  # noqa: S101 - the loop leaves only with a proven config
        d, source, outcome = proven
        return self.result(d, True, source, prerun, outcome)

    def repeat(self, r: TuneResult) -> TuneResult:
        """Prove the final configuration on --repeat-proof boots in all; the pool keeps at least
        the headroom floor (`pretuner.noise`) and their spread above the highest worst-rank
        peak (else derived again with that much more headroom and proven again, within
        --max-launches)."""
        while r.validated:
            first, prerun = r.validation, r.prerun
            if first is None or prerun is None:
                return r
            s = first.settings
            boots = [first]
            while len(boots) < self.cfg.repeat_proof and self.launches_left() > 0:
                o = self.launch(s)
                if o.kind is not OutcomeKind.OK or o.requests_ok != o.requests_total:
                    raise crash_error(o, f"repeated proof (boot {len(boots) + 1})")
                boots.append(o)
            peaks = tuple(o.worst_peak_mib or 0 for o in boots)
            self.spread = max(self.spread, noise.spread_mib(peaks))
            cap = round(s.card_gib * s.util * 1024)
            floor = self.floor_bytes() // MIB
            short = max(0, floor - (cap - max(peaks)))
            kept = (f"the pool (card*util = {cap:,} MiB) keeps {cap - max(peaks):,} MiB above "
                    f"the highest, at least "
                    f"{noise.floor_words(self.cfg.card.card_gib * 1024, self.spread)} asked")
            if len(peaks) > 1:
                self.decide(
                    "boot spread",
                    f"{len(peaks)} boots of the proven configuration: worst-rank peaks "
                    + ", ".join(f"{p:,}" for p in peaks) + f" MiB ({self.seen}), spread "
                    f"{noise.spread_mib(peaks):,} MiB; {kept}",
                    boot_peaks_mib=list(peaks), spread_mib=noise.spread_mib(peaks))
            r = replace(r, boot_peaks_mib=peaks)
            if short == 0:
                return r
            if self.launches_left() <= 0:
                self.decide("headroom short", f"{kept}: {short:,} MiB short and no launch left "
                            f"(--max-launches {self.cfg.max_launches}): the configuration proven "
                            "stands")
                return r
            # The shortfall comes out of the KV cache: past what the integer model-use's rounding
            # already holds, so that the budget rounds up.
            d = r.derivation
            base = (int(d.inputs.headroom_gib * GIB) + d.rounding_cost_bytes + short * MIB
                    + bud.BASE_HEADROOM_FLOOR_BYTES)
            self.decide("hold back", f"{kept}: {short:,} MiB short; "
                        f"derived again with {(base - int(d.inputs.headroom_gib * GIB)) / MIB:,.0f}"
                        " MiB more headroom (the shortfall, the integer model-use's rounding and "
                        f"{bud.BASE_HEADROOM_FLOOR_BYTES // MIB} MiB), proven in turn")
            try:
                lower, source = self.derive(prerun, per_seq=d.inputs.per_seq_bytes, base=base)
            except InfeasibleError:
                self.decide("headroom short", f"{short:,} MiB more headroom leaves no "
                            "configuration: the one proven stands")
                return r
            r = self.validate(prerun, lower, source)
        return r

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
        margin = self.one_sequence_margin(full)
        # derive() adds base + slope x (sequences - 1): at `seqs` that is full - wa + margin.
        base = max(0, full - wa + margin - slope * (seqs - 1))
        try:
            cand, source = self.derive(prerun, per_seq=slope, base=base, announce=False)
        except PretunerError:
            return None
        edge = self.edge(prerun, cand, base, margin, slope)
        if edge is not None:
            cand, source, margin = edge
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
            f"under full load ({seqs} sequences) the worst rank held {full / GIB:.2f} GiB "
            f"besides the KV cache ({self.seen}: {(full - wa) / MIB:,.0f} MiB above the "
            "pre-run); with that "
            f"and a {margin / MIB:,.0f} MiB margin the KV cache grows by {gain / GIB:.2f} GiB to "
            f"{cand.final.max_num_seqs} sequences: validating it",
            vllm_model_memory_use_gb=cand.final.vllm_model_memory_use_gb,
            max_num_seqs=cand.final.max_num_seqs,
        )
        return cand, source

    def edge(
        self, prerun: LaunchOutcome, cand: Derivation, base: int, margin: int, slope: int
    ) -> tuple[Derivation, str, int] | None:
        """(derivation, source, margin kept) one integer GiB of model-use lower, when only the
        margin's share of the activations pushes the budget over that integer (a whole GiB of
        KV for a few MiB); it keeps the boot-noise floor (`pretuner.noise`)."""
        least = self.floor_bytes()
        try:
            low, source = self.derive(prerun, per_seq=slope, base=base - margin + least,
                                      announce=False)
        except PretunerError:
            return None
        use = low.final.vllm_model_memory_use_gb
        if use >= cand.final.vllm_model_memory_use_gb:
            return None
        # What the budget holds besides the margin, at the sequences the lower one serves.
        need = low.weights_act_bytes + base - margin + slope * (low.final.max_num_seqs - 1)
        kept = use * GIB - need
        self.decide(
            "integer edge",
            f"a {margin / MIB:,.1f} MiB margin would round the model-use budget up to "
            f"{cand.final.vllm_model_memory_use_gb} GiB; {use} GiB keeps {kept / MIB:,.1f} MiB "
            f"above what the full load {self.seen} needs and gives the KV cache "
            f"{(low.final.kv_bytes - cand.final.kv_bytes) / GIB:.2f} GiB more",
        )
        return low, source, kept

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
                per_seq, int((need - wa - self.base_headroom) / (seqs - 1) * (1 + LEARN_MARGIN)),
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
        half = self.most_room(prerun, seqs // 2, d) if seqs >= 4 else None
        if half is not None:
            new, source = half
            self.decide(
                "learn from the validation",
                why + f"; a dump bounds the need only from below, so the next validation "
                f"measures {new.final.max_num_seqs} sequences with model-use "
                f"{new.final.vllm_model_memory_use_gb} GiB (all the room their KV cache leaves); "
                "what it measures sets max-num-seqs",
                max_num_seqs=new.final.max_num_seqs,
            )
            return prerun, new, source, per_seq
        try:
            new, source = self.derive(prerun, per_seq=per_seq)
        except InfeasibleError:
            shorter = [n for n in self.fits[prerun.settings.chunked_prefill]
                       if n < prerun.settings.max_model_len]
            if not shorter:
                raise NotValidatedError(
                    f"validation at {prerun.settings.max_model_len:,} tokens ran out of memory "
                    f"and no shorter length was {self.seen} to fit",
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

    def most_room(
        self, prerun: LaunchOutcome, seqs: int, failed: Derivation
    ) -> tuple[Derivation, str] | None:
        """The configuration that serves at least `seqs` sequences with every GiB their KV cache
        leaves given to the model-use budget: a measurement of the load's real cost, more room
        than the one that failed; None when there is no more room."""
        wa = failed.weights_act_bytes
        for use in range(self.cfg.card.card_gib, failed.final.vllm_model_memory_use_gb, -1):
            base = use * GIB - wa - MIB  # the integer model-use rounds up to `use`
            if base <= 0:
                return None
            try:
                d, source = self._derive(prerun, 0, base, announce=False)
            except PretunerError:
                continue
            f = d.final
            if f.max_num_seqs >= seqs and f.vllm_model_memory_use_gb == use:
                return d, source
        return None
