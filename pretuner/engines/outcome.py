"""What one launch came to: its kind, its figures, and what its requests got.

Data and pure helpers shared by every engine's classifier (`pretuner.engines`) and the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from pretuner.engines.base import LaunchSettings, Phase, Purpose
from pretuner.errors import RequestRefusedError
from pretuner.launch import probe
from pretuner.launch.sampler import requests_status
from pretuner.speed import Speed


class OutcomeKind(str, Enum):
    OK = "ok"
    OOM_AT_START = "oom_at_start"  # weights + warm-up did not fit in model-use
    OOM_IN_REQUEST = "oom_in_request"  # activation of the probe/load did not fit
    KV_EXHAUSTED = "kv_blocks_exhausted"  # KV blocks <= 0 at start
    DEVICE_REFUSED = "device_memory_refused"  # card*util above the card's free memory
    LEN_TOO_LARGE = "max_model_len_too_large"  # max_model_len above the KV token count
    REQUESTS_FAILED = "requests_failed"  # requests failed without any OOM line
    # The probe never ran: the scheduler dropped it (KV too small for one max-length sequence
    # beside vLLM's block watermark) and answered with an empty completion.
    PROMPT_DROPPED = "prompt_dropped"
    OOM_WEIGHTS = "oom_loading_weights"  # out of memory before the weights finished loading

    @property
    def is_oom(self) -> bool:
        return self in _OOM_KINDS


_OOM_KINDS = frozenset(
    (OutcomeKind.OOM_AT_START, OutcomeKind.OOM_IN_REQUEST, OutcomeKind.OOM_WEIGHTS)
)


@dataclass(frozen=True, slots=True)
class LaunchOutcome:
    n: int
    settings: LaunchSettings
    kind: OutcomeKind
    worst_peak_mib: int | None
    rank_peaks_mib: dict[str, int]
    oom_text: str | None
    requests_ok: int
    requests_total: int
    ready_s: float
    request_s: float
    stop_s: float
    total_s: float
    overhead_s: float  # pretuner's own time: everything but waiting on the server
    log_path: str
    device_free_mib: int | None = None
    estimated_max_len: int | None = None
    request_error: str | None = None  # the first failed request's error, as the client saw it
    notes: tuple[str, ...] = field(default=())
    worst_node: str | None = None  # the node the worst rank ran on (multi-node via Ray)
    weights_gib: float | None = None  # "Loading model weights took X GB" (GiB), when printed
    oom_alloc_bytes: int | None = None  # the allocation that failed, when an OOM says
    requests_dropped: int = 0  # requests answered without running (empty completion)
    server_exit_code: int | None = None  # the server exited by itself before it was stopped
    device_peaks_mib: dict[str, int] = field(default_factory=dict)  # phase -> worst device, MiB
    device_reader: str | None = None  # what sampled the card (None: measured from the logs)
    device_total_mib: int | None = None  # the sampled device's total, as its reader says
    compile_cache: str | None = None  # the engine's compile cache at launch: cold, warm, off, n/a
    kv_tokens: int | None = None  # V1 engines: the KV cache's token count, from the log
    kv_gib: float | None = None  # V1 engines: the KV cache as pinned or profiled, from the log
    device_last_mib: dict[str, int] = field(default_factory=dict)  # phase -> its last sample
    soak_requests: int = 0  # mixed requests the soak sent (vision-language validation)
    reset_status: int | None = None  # POST /reset_mm_cache's HTTP status (0: no answer)
    encoder_budget_tokens: int | None = None  # V1, vision-language: the engine's log says
    encoder_profiled_items: int | None = None
    speed: Speed | None = None  # V1 validations: time to first token and decode tokens/s
    # V1 engines that profiled: the KV bytes their log suggests, to fit the requested util and
    # to fill the device (shown beside pretuner's, never adopted)
    advised_kv_bytes: int | None = None
    advised_full_kv_bytes: int | None = None
    # A soak's samples of the worst device, (seconds since the launch started, MiB): its rate
    soak_series: tuple[tuple[float, int], ...] = ()
    # On a Ray cluster: node label -> the peak of its worst device this launch, MiB (measured)
    node_peaks_mib: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, n: int, settings: LaunchSettings, kind: OutcomeKind, log_path: Path,
           ran: Exercised, times: tuple[float, float, float, float], exited: int | None,
           **figures: Any) -> LaunchOutcome:
        """A finished launch: what its requests got, its timings, and the engine's figures."""
        ready_s, request_s, stop_s, total_s = times
        return cls(n=n, settings=settings, kind=kind, requests_ok=ran.ok, requests_total=ran.total,
                   ready_s=round(ready_s, 3), request_s=round(request_s, 3),
                   stop_s=round(stop_s, 3), total_s=round(total_s, 3),
                   overhead_s=round(max(0.0, total_s - ready_s - request_s - stop_s), 3),
                   log_path=str(log_path), request_error=ran.error, server_exit_code=exited,
                   **figures)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = self.settings.to_json()
        data["kind"] = self.kind.value
        data["notes"] = list(self.notes)
        data["speed"] = self.speed.to_json() if self.speed is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchOutcome:
        fields_ = dict(data)
        fields_["settings"] = LaunchSettings.from_json(fields_["settings"])
        fields_["kind"] = OutcomeKind(fields_["kind"])
        fields_["notes"] = tuple(fields_.get("notes", ()))
        fields_["soak_series"] = tuple((t, mib) for t, mib in fields_.get("soak_series", ()))
        if isinstance(fields_.get("speed"), dict):
            fields_["speed"] = Speed.from_json(fields_["speed"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in fields_.items() if k in known})


def kind_of(refused: OutcomeKind | None, oom: bool, in_request: bool, weights_loaded: bool,
            failure: object, dropped: bool, ran: Exercised) -> OutcomeKind | None:
    """A launch's kind, every engine's: the engine's refusal, else where an OOM struck, else
    what the requests got; None when a failure has no line that explains it."""
    if refused is not None:
        return refused
    if oom:
        if in_request:
            return OutcomeKind.OOM_IN_REQUEST
        # Before the engine says the weights are in, the weights themselves did not fit.
        return OutcomeKind.OOM_AT_START if weights_loaded else OutcomeKind.OOM_WEIGHTS
    if failure is not None:
        return None
    if dropped:
        return OutcomeKind.PROMPT_DROPPED
    if ran.total and ran.ok < ran.total:
        return OutcomeKind.REQUESTS_FAILED
    return OutcomeKind.OK


# What each sampled phase of a launch is, for the verdict that names the one that set the
# peak (`launch.sampler` tags every sample with the phase the exercise announced).
PHASE_WORDS = {
    "launch": "start-up", "loading": "start-up (weights, profiling, graphs, warm-up)",
    "ready": "start-up", "probe": "the max-length request",
    "worst": "the worst single request (a max-length request alone)",
    "load": "the concurrent max-length requests",
    "burst": "the short burst (max-num-seqs requests at once)",
    "images": "the concurrent worst-case image requests", "soak-1": "the soak's first half",
    "soak-2": "the soak's second half", "reset": "the multimodal cache reset",
    "after-soak": "the image burst after the soak", "stop": "the stop",
}


def peak_phase(peaks_mib: dict[str, int]) -> str | None:
    """The phase that set a launch's device peak: the first to reach it (the device's level
    only grows while torch keeps what it cached); None when nothing was sampled."""
    return max(peaks_mib, key=peaks_mib.__getitem__, default=None)


# One launch: run for real (`tune.execute.recorded_executor`), replayed, or scripted in a test.
Executor = Callable[[LaunchSettings], LaunchOutcome]


class RequestContext(Protocol):
    """What a launch's requests need of the run's launch context (`tune.execute.LaunchContext`)."""

    @property
    def served_name(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def decode_tokens(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def burst_tokens(self) -> int: ...


def workload(s: LaunchSettings, decode_tokens: int) -> tuple[int, int, int]:
    """(requests, prompt tokens each, tokens to generate each) of a launch's exercise."""
    if s.purpose is Purpose.PRERUN:
        return 1, probe.max_length_prompt_len(s.max_model_len, 1), 1
    decode = decode_len(s, decode_tokens)
    return s.max_num_seqs, probe.max_length_prompt_len(s.max_model_len, decode), decode


# A burst request's prompt: short, as production's chat turns are; what matters is the width.
BURST_PROMPT_TOKENS = 128
# What each generates on an accelerator: long enough that the requests, which reach the server
# over a second or so, decode together (CPU engines: their validation's few decode tokens).
BURST_OUTPUT_TOKENS = 128


@dataclass(frozen=True, slots=True)
class Burst:
    """The proof's wide short burst: `requests` at once, each `prompt_len` + `max_tokens`."""

    requests: int
    prompt_len: int
    max_tokens: int


def burst_shape(s: LaunchSettings, kv_tokens: int | None, out_tokens: int) -> Burst:
    """max-num-seqs short requests sized so that all of them run in one batch: the widest
    batch production reaches, where the logits and the sampler's buffers (rows x vocabulary)
    peak. `kv_tokens` None: the KV cache holds max-num-seqs max-length sequences (r0.1).

    - at most max-num-batched-tokens requests: a decode step takes one token of each;
    - each gets an equal share of the KV cache in whole blocks (and of max_model_len), so
      the engine never preempts one: fewer requests only when the cache has fewer blocks;
    - the prompts are prefilled over ceil(requests x prompt / max-num-batched-tokens) steps;
      each request generates twice that (at least `out_tokens`), so all of them decode
      together for at least as many steps as the prefill took."""
    count = max(1, min(s.max_num_seqs, s.max_num_batched_tokens))
    room = s.max_model_len
    if kv_tokens is not None:
        blocks = max(1, kv_tokens // s.block_size)
        count = min(count, blocks)
        room = min(room, blocks // count * s.block_size)
    prompt = max(1, min(BURST_PROMPT_TOKENS, room // 2))
    steps = -(-count * prompt // s.max_num_batched_tokens)
    out = max(1, min(room - prompt, max(out_tokens, 2 * steps)))
    return Burst(count, prompt, out)


def decode_len(s: LaunchSettings, decode_tokens: int) -> int:
    """Tokens each validation request generates after its prompt."""
    return min(decode_tokens, max(1, s.max_model_len // 2))


def probe_one(s: LaunchSettings, ctx: RequestContext, base: str, phase: Phase) -> Exercised:
    """The pre-run's one max-length request."""
    plen = probe.max_length_prompt_len(s.max_model_len, 1)
    phase("probe", f"one request of {plen + 1:,} tokens")
    prompt = probe.probe_prompt(plen, ctx.seed, ctx.vocab_size)
    return tally([probe.complete(base, ctx.served_name, prompt, 1, ctx.request_timeout_s)], plen)


# The burst's prompts differ from the load's (no prefix-cache hit shortens their prefill).
BURST_SEED_OFFSET = 104729


def short_burst(s: LaunchSettings, ctx: RequestContext, base: str, phase: Phase,
                kv_tokens: int | None, before: Exercised) -> Exercised:
    """The proof's wide short burst (`burst_shape`), counted with what ran `before` it."""
    b = burst_shape(s, kv_tokens, ctx.burst_tokens)
    phase("burst", f"{b.requests:,} concurrent short requests of {b.prompt_len} + "
          f"{b.max_tokens} tokens: the widest batch max-num-seqs {s.max_num_seqs} allows")
    got = tally(probe.load(base, ctx.served_name, b.requests, b.prompt_len, b.max_tokens,
                           ctx.seed + BURST_SEED_OFFSET, ctx.request_timeout_s, ctx.vocab_size,
                           on_done=requests_status(phase)).outcomes, b.prompt_len)
    return joined(before, got)


def joined(before: Exercised, after: Exercised) -> Exercised:
    """Two parts of one launch's requests, counted together (the first error named)."""
    return Exercised(before.ok + after.ok, before.total + after.total,
                     before.dropped + after.dropped, before.error or after.error)


def tally(outs: Sequence[probe.CompletionOutcome], prompt_len: int | None) -> Exercised:
    """Count what really ran: a reply must carry a generated token for a prompt of the length
    sent (`usage`): vLLM drops a prompt its KV cache cannot admit and still answers 200.
    `prompt_len` None: chat requests, whose length the server counts (its template)."""
    dropped = [o for o in outs if o.ok and o.completion_tokens == 0]
    short = [o for o in outs if o.ok and o.completion_tokens != 0 and o.prompt_tokens is not None
             and prompt_len is not None and o.prompt_tokens != prompt_len]
    failed = [o for o in outs if not o.ok]
    refused = next((o for o in failed if 400 <= o.status < 500), None)
    if refused is not None:  # not the card, not the server: no verdict either way
        raise RequestRefusedError(
            f"the server refused a request pretuner sent (HTTP {refused.status}: "
            f"{refused.error}): pretuner built a request this server or model does not accept",
            hint="this is pretuner's error, not a memory or server failure; please report it "
            "with the run folder")
    error = None
    if failed:
        o = failed[0]
        error = f"HTTP {o.status}: {o.error}" if o.status else str(o.error)
    elif short:
        error = (f"the server counted {short[0].prompt_tokens:,} prompt tokens, not the "
                 f"{prompt_len:,} sent")
    ok = len(outs) - len(failed) - len(dropped) - len(short)
    return Exercised(ok, len(outs), len(dropped), error)


@dataclass(frozen=True, slots=True)
class Exercised:
    ok: int
    total: int
    dropped: int  # answered 200 without generating a token: the prompt never ran
    error: str | None
    soak_requests: int = 0  # of `total`, the soak's
    reset_status: int | None = None  # POST /reset_mm_cache's HTTP status, when asked
    speed: Speed | None = None  # what the requests' timing showed (V1 validations)
