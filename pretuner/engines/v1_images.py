"""How a V1 engine serving a vision-language model is exercised: every request through the
chat API with the most images of the largest size a prompt may carry.

Pre-run: two short text requests calibrate the prompt length the server counts, then one
worst-case image request (text filling the rest of max_model_len), then the wide short burst.
Validation, worst first: the longest text prefill alone, then as many worst-case image requests
at once as the KV cache holds (at most max-num-seqs), then the wide short burst
(`outcome.burst_shape`); with a soak, a bounded mixed load in two halves (sizes and counts
varied, every image distinct, so the caches that grow with distinct images fill), a cache reset
where the server allows it, and the image burst again on top of what the soak left. Each part
is its own sampled phase: the loop reads the soak's growth from their levels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretuner.engines.base import LaunchSettings, Phase, Purpose
from pretuner.engines.outcome import Exercised, decode_len, joined, short_burst, tally
from pretuner.launch import chat
from pretuner.launch.images import (
    IMAGE_WRAP_TOKENS,
    ImageShape,
    LoadPhase,
    MMRequest,
    validation_phases,
    worst_case,
)
from pretuner.launch.probe import CompletionOutcome
from pretuner.launch.sampler import requests_status

if TYPE_CHECKING:
    from pretuner.engines.outcome import RequestContext

RESET_SETTLE_S = 0.5  # sampled after the reset, so that the chart and the record see it
SOAK_PHASES = ("soak-1", "soak-2")
# A soak given in minutes only: at most this many requests a minute are planned (the deadline
# ends it first on any real server).
SOAK_REQUESTS_PER_MINUTE = 600


@dataclass(frozen=True, slots=True)
class Soak:
    """`--soak N` and/or `--soak-minutes M`: whichever ends first."""

    requests: int | None = None
    minutes: float | None = None

    @property
    def planned(self) -> int:
        """The requests planned: N, else what M minutes could take."""
        if self.requests is not None:
            return self.requests
        return int((self.minutes or 0) * SOAK_REQUESTS_PER_MINUTE)

    @property
    def on(self) -> bool:
        return self.planned > 0

    def words(self) -> str:
        parts = ([f"{self.requests:,} requests"] if self.requests is not None else []) + (
            [f"{self.minutes:g} min"] if self.minutes is not None else [])
        return " or ".join(parts) + (", whichever ends first" if len(parts) == 2 else "")


def describe(req: MMRequest) -> str:
    """`2 images of 4096x4096 px (16,384 tokens each) + 32,700 text tokens`."""
    if not req.images:
        return f"{req.text_tokens:,} text tokens"
    a = req.images[0]
    return (f"{len(req.images)} image(s) of {a.width_px}x{a.height_px} px ({a.tokens:,} tokens "
            f"each, +{IMAGE_WRAP_TOKENS} around each) + {req.text_tokens:,} text tokens")


def exercise_images(shape: ImageShape, soak: Soak, s: LaunchSettings, ctx: RequestContext,
                    base: str, phase: Phase, count: int, kv_tokens: int | None) -> Exercised:
    """The pre-run's worst-case image request, or the validation (module docstring)."""
    name, timeout = ctx.served_name, ctx.request_timeout_s
    phase("probe" if s.purpose is Purpose.PRERUN else "load",
          "two short text requests: the prompt length the server counts")
    cal = chat.calibrate(base, name, timeout)
    if isinstance(cal, CompletionOutcome):
        return tally([cal], None)
    if s.purpose is Purpose.PRERUN:
        req = worst_case(shape, s.max_model_len, 1, f"probe/{ctx.seed}", cal.template_tokens)
        phase("probe", f"one chat request: {describe(req)} (template {cal.template_tokens} "
              "tokens, counted by the server)")
        ran = tally([chat.send_fitted(base, name, req, cal, "probe", s.max_model_len,
                                      timeout)], None)
        return ran if ran.ok < ran.total else short_burst(s, ctx, base, phase, kv_tokens, ran)
    decode = decode_len(s, ctx.decode_tokens)
    phases = validation_phases(shape, s.max_model_len, decode, count, soak.planned, ctx.seed,
                               cal.template_tokens)
    outs: list[CompletionOutcome] = []
    burst_ran = Exercised(0, 0, 0, None)
    soaked = 0
    reset: int | None = None
    half_s = None if soak.minutes is None else soak.minutes * 30
    for p in phases:
        # --soak-minutes: each half of the soak stops starting requests after half of them
        half = time.monotonic() + half_s if p.name in SOAK_PHASES and half_s else None
        phase(p.name, phase_words(p, soak))
        got = chat.run_phase(base, name, p, cal, s.max_model_len, timeout,
                             vocab_size=ctx.vocab_size, deadline=half,
                             on_done=requests_status(phase))
        outs += got
        if p.name in SOAK_PHASES:
            soaked += len(got)
        if not all(o.ok for o in got):
            break
        if p.name == "images":  # the wide short burst, before any soak grows the level
            burst = short_burst(s, ctx, base, phase, kv_tokens, Exercised(0, 0, 0, None))
            burst_ran = joined(burst_ran, burst)
            if burst.ok < burst.total:
                break
        if p.reset:
            reset = chat.reset_mm_cache(base, timeout)
            phase("reset", f"POST /reset_mm_cache: HTTP {reset or 'no answer'}; the device "
                  "sampled after it")
            time.sleep(RESET_SETTLE_S)
    ran = joined(tally(outs, None), burst_ran)
    return Exercised(ran.ok, ran.total, ran.dropped, ran.error, soaked, reset)


def phase_words(p: LoadPhase, soak: Soak) -> str:
    if p.name == "worst":
        return f"worst case first: the longest text prefill alone ({p.requests[0].max_tokens} " \
               "tokens generated)"
    if p.name in SOAK_PHASES:
        return (f"soak half {p.name[-1]}: {len(p.requests):,} mixed image requests, "
                f"{p.concurrency} in flight ({soak.words()})")
    first = p.requests[0]
    what = describe(first) if isinstance(first, MMRequest) else "text"
    after = " again, on top of what the soak left" if p.name == "after-soak" else ""
    return f"{len(p.requests)} concurrent chat requests{after}: {what}"
