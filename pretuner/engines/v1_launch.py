"""How a V1 engine's launch is exercised and judged.

Exercise: the pre-run sends one max-length request (its prefill runs in
`max_num_batched_tokens` steps, the worst step at full context), then the wide short burst, so
that the peak it measures has the widest batch in it. A validation sends the worst
case first, that request alone ("worst"), then as many concurrent max-length requests as the KV
cache holds, at most max-num-seqs ("load": the shape the real H100 runs were proven with), then
max-num-seqs short requests at once ("burst", `outcome.burst_shape`): the widest batch, where
the logits and the sampler peak. Each is its own sampled phase, its peak recorded.

Judge: V1 engines print no pool dump; the memory figure is the sampled device peak. What the
log says decides the kind: vLLM's refusals, a torch/CPU allocator OOM at start-up (before or
after the weights were in) or while serving (the engine is dead from then on, HTTP 500).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from pathlib import Path

from pretuner.engines.base import LaunchSettings, Phase, Purpose
from pretuner.engines.outcome import (
    Exercised,
    LaunchOutcome,
    OutcomeKind,
    RequestContext,
    decode_len,
    kind_of,
    probe_one,
    short_burst,
    tally,
)
from pretuner.engines.v1_images import Soak, exercise_images
from pretuner.errors import ServerFailedError
from pretuner.launch import probe
from pretuner.launch.images import ImageShape
from pretuner.launch.probe import Arrivals, CompletionOutcome, LoadOutcome, stream_complete
from pretuner.launch.process import log_hint
from pretuner.launch.sampler import requests_status
from pretuner.logscan import scan_paths
from pretuner.logscan.v1 import V1Log
from pretuner.speed import Speed
from pretuner.units import GIB, MIB


def read_log(path: Path) -> V1Log:
    return scan_paths([path]).v1 if path.exists() else V1Log()


def concurrency(s: LaunchSettings, kv_tokens: int | None, bytes_per_token: int) -> int:
    """How many max-length requests a validation sends at once: what the KV cache holds (the
    engine's token count, else the pinned bytes), at most max-num-seqs, at least one."""
    if kv_tokens is None and s.kv_cache_bytes is not None and bytes_per_token > 0:
        kv_tokens = s.kv_cache_bytes // bytes_per_token
    fits = (kv_tokens or s.max_model_len) // s.max_model_len
    return max(1, min(s.max_num_seqs, fits))


def classify(v1: V1Log, ran: Exercised, failure: ServerFailedError | None) -> OutcomeKind | None:
    """The launch's kind from its log and requests; None when nothing explains a failure."""
    refused = (OutcomeKind.DEVICE_REFUSED if v1.refused_free_gib is not None else
               OutcomeKind.LEN_TOO_LARGE if v1.estimated_max_len is not None else
               OutcomeKind.KV_EXHAUSTED if v1.no_kv_memory else None)
    return kind_of(refused, v1.failed_oom, v1.ready and bool(ran.total), v1.weights_loaded,
                   failure, bool(ran.dropped), ran)


@dataclass(frozen=True, slots=True)
class V1Hooks:
    """How a V1 engine's launch is exercised and judged; `images`: a vision-language model's
    (its requests go through the chat API with images, `pretuner.engines.v1_images`)."""

    bytes_per_token: int
    images: ImageShape | None = None
    soak: Soak = Soak()

    def exercise(self, s: LaunchSettings, ctx: RequestContext, base: str, phase: Phase,
                 log_path: Path) -> Exercised:
        if self.images is not None and not self.images.is_text_only:
            kv_tokens = read_log(log_path).kv_tokens
            count = concurrency(s, kv_tokens, self.bytes_per_token)
            return exercise_images(self.images, self.soak, s, ctx, base, phase, count, kv_tokens)
        if s.purpose is Purpose.PRERUN:  # the production shape: its widest batch included
            ran = probe_one(s, ctx, base, phase)
            if ran.ok < ran.total:
                return ran
            return short_burst(s, ctx, base, phase, read_log(log_path).kv_tokens, ran)
        decode = decode_len(s, ctx.decode_tokens)
        plen = probe.max_length_prompt_len(s.max_model_len, decode)
        phase("worst", f"worst case first: one request of {plen + decode:,} tokens alone, "
              "streamed (time to first token, decode tokens/s)")
        first, arrivals = stream_complete(base, ctx.served_name,
                                          probe.probe_prompt(plen, ctx.seed + 7919, ctx.vocab_size),
                                          decode, ctx.request_timeout_s)
        if not first.ok:
            return tally([first], plen)
        kv_tokens = read_log(log_path).kv_tokens
        count = concurrency(s, kv_tokens, self.bytes_per_token)
        phase("load", f"{count} concurrent requests of {plen + decode:,} tokens")
        full = probe.load(base, ctx.served_name, count, plen, decode, ctx.seed,
                          ctx.request_timeout_s, ctx.vocab_size, on_done=requests_status(phase))
        ran = tally([first, *full.outcomes], plen)
        speed = streamed_speed(first, arrivals, full, plen)
        if ran.ok < ran.total:
            return replace(ran, speed=speed)
        return replace(short_burst(s, ctx, base, phase, kv_tokens, ran), speed=speed)

    def outcome(self, n: int, s: LaunchSettings, log_path: Path, ran: Exercised,
                failure: ServerFailedError | None, exited: int | None,
                times: tuple[float, float, float, float]) -> LaunchOutcome:
        v1 = read_log(log_path)
        kind = classify(v1, ran, failure)
        if kind is None and v1.killed_by_signal == signal.SIGKILL:  # not the card: the host
            raise host_killed(log_path)
        if kind is None:  # only for an unexplained failure
            raise failure or unexplained_exit(log_path, exited or 0)
        free = v1.initial_free_gib if v1.initial_free_gib is not None else v1.refused_free_gib
        return LaunchOutcome.of(
            n, s, kind, log_path, ran, times, exited,
            worst_peak_mib=None,  # no pool dump: the device sampler's peaks are the figure
            rank_peaks_mib={}, oom_text=v1.oom_text,
            device_free_mib=round(free * GIB / MIB) if free is not None else None,
            estimated_max_len=v1.estimated_max_len, weights_gib=v1.weights_gib,
            oom_alloc_bytes=v1.oom_alloc_bytes, requests_dropped=ran.dropped,
            kv_tokens=v1.kv_tokens, kv_gib=v1.kv_gib, soak_requests=ran.soak_requests,
            reset_status=ran.reset_status, encoder_budget_tokens=v1.encoder_budget_tokens,
            encoder_profiled_items=v1.encoder_profiled_items, speed=ran.speed,
            advised_kv_bytes=v1.advice.requested_bytes if v1.advice else None,
            advised_full_kv_bytes=v1.advice.full_bytes if v1.advice else None,
            compile_cache=v1.compile_cache,
        )


def streamed_speed(first: CompletionOutcome, arrivals: Arrivals | None, burst: LoadOutcome,
                   prompt_len: int) -> Speed | None:
    """The speed figures of a validation: the streamed lone request, then the burst."""
    if arrivals is None:
        return None
    tokens = (first.completion_tokens or arrivals.chunks) - 1
    return Speed(prompt_tokens=prompt_len, ttft_s=round(arrivals.first_s, 4),
                 decode_tokens=max(0, tokens),
                 decode_s=round(arrivals.last_s - arrivals.first_s, 4),
                 load_requests=len(burst.outcomes),
                 load_tokens=sum(o.completion_tokens or 0 for o in burst.outcomes if o.ok),
                 load_s=round(burst.wall_seconds, 4), how="streamed",
                 decode_chunks=arrivals.chunks - 1)


def host_killed(log_path: Path) -> ServerFailedError:
    """An engine killed while starting: on Linux, the kernel's OOM killer (host memory)."""
    return ServerFailedError(
        "the engine was killed by signal 9 while it started: the host ran out of memory (the "
        "kernel's OOM killer), not the device; pinned --cpu-offload-gb weights and the "
        "server's own processes did not fit the host",
        hint=f"lower --cpu-offload-gb or free host memory (dmesg names the kill); "
        f"{log_hint(log_path)}",
        log_path=str(log_path),
    )


def unexplained_exit(log_path: Path, code: int) -> ServerFailedError:
    """A server that exited before it was ready, with no line that says why."""
    return ServerFailedError(
        f"the server exited with code {code} before it was ready",
        hint=log_hint(log_path), log_path=str(log_path),
    )
