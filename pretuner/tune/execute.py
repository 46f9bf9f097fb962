"""One launch, start to finish: start the server, probe or load it, stop it gracefully, scan
its log, and say what happened in one classified outcome."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from pretuner.devices import DeviceReader
from pretuner.errors import ServerFailedError
from pretuner.launch import probe
from pretuner.launch.process import ServerProcess, read_tail
from pretuner.launch.sampler import MemorySampler
from pretuner.logscan import Located, OomEvent, OomKind, ScanResult
from pretuner.logscan.lines import DeviceMemoryInit
from pretuner.tune.collect import CollectorFactory, LocalCollector
from pretuner.tune.crash import device_busy
from pretuner.tune.record import RunRecord
from pretuner.tune.settings import LaunchCommand, LaunchSettings, Purpose

log = logging.getLogger(__name__)

CRASH_SETTLE_S = 1.0  # how long a server whose requests failed may take to finish dying

Phase = Callable[[str, str], None]  # (phase, detail) -> None, for the progress display


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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"] = self.settings.to_json()
        data["kind"] = self.kind.value
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchOutcome:
        fields_ = dict(data)
        fields_["settings"] = LaunchSettings.from_json(fields_["settings"])
        fields_["kind"] = OutcomeKind(fields_["kind"])
        fields_["notes"] = tuple(fields_.get("notes", ()))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in fields_.items() if k in known})


@dataclass(frozen=True, slots=True)
class LaunchContext:
    """What every launch of a run shares."""

    build: Callable[[LaunchSettings, int], LaunchCommand]  # (settings, port) -> command
    served_name: str
    host: str = "127.0.0.1"
    ready_timeout_s: float = 1800.0
    request_timeout_s: float = 900.0
    stop_grace_s: float = 120.0
    decode_tokens: int = 16
    seed: int = 0
    collector: CollectorFactory | None = None  # where logs are read; default: this machine
    device_reader: DeviceReader | None = None  # samples the card during launches; None: logs only


class _OomSeen(Exception):
    """Raised from the readiness/request wait when the live log shows an OOM."""



_START_KINDS = {
    "KV_BLOCKS_EXHAUSTED": OutcomeKind.KV_EXHAUSTED,
    "MAX_DEVICE_MEMORY_RANGE": OutcomeKind.DEVICE_REFUSED,
    "MAX_MODEL_LEN_TOO_LARGE": OutcomeKind.LEN_TOO_LARGE,
}


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_launch(
    n: int, settings: LaunchSettings, ctx: LaunchContext, record: RunRecord, phase: Phase
) -> LaunchOutcome:
    """Start, exercise, stop and scan one server; fatal surprises raise ServerFailedError."""
    t0 = time.monotonic()
    folder = record.launch_dir(n)
    port = free_port(ctx.host)
    log_path = folder / "server.log"
    collector = (ctx.collector or LocalCollector)(folder, log_path)
    cmd = collector.prepare(ctx.build(settings, port))
    shown = cmd.redacted()  # the secrets of --serve-cmd and the environment never stored
    (folder / "command.json").write_text(
        json.dumps({"argv": shown.argv, "env": shown.env, "shell": shown.shell_line()}, indent=2)
        + "\n",
        encoding="utf-8",
    )
    seen: list[OomKind] = []
    free: list[int] = []

    def consume(events: list[Located]) -> None:
        for located in events:
            event = located.event
            if isinstance(event, OomEvent):
                seen.append(event.kind)
            elif isinstance(event, DeviceMemoryInit) and event.device_free_mib:
                free.append(event.device_free_mib)

    def check() -> None:
        consume(collector.poll())
        if seen:
            raise _OomSeen

    base = f"http://{ctx.host}:{port}"
    ready_s = request_s = 0.0
    ok = total = dropped = 0
    first_error: str | None = None
    failure: ServerFailedError | None = None
    exited: int | None = None
    sampler = MemorySampler(ctx.device_reader)
    phase = sampler.wrap(phase)
    phase("launch", f"{settings.purpose.value} {_describe(settings)}")
    proc = ServerProcess.start(cmd.argv, {**os.environ, **cmd.env}, log_path)
    sampler.start()
    try:
        try:
            phase("loading", f"waiting for {base}/health")
            w0 = time.monotonic()
            proc.wait_ready(f"{base}/health", ctx.ready_timeout_s, check=check)
            ready_s = time.monotonic() - w0
            phase("ready", f"after {ready_s:.1f} s")
            r0 = time.monotonic()
            ran = _exercise(settings, ctx, base, phase)
            ok, total, dropped, first_error = ran.ok, ran.total, ran.dropped, ran.error
            request_s = time.monotonic() - r0
            with contextlib.suppress(_OomSeen):
                check()
        except _OomSeen:
            pass
        except ServerFailedError as err:
            failure = err
        # A server that dropped a request is often still dying: a moment lets a crash be
        # named one (its exit code) instead of an error answer.
        exited = proc.poll_settled(CRASH_SETTLE_S if ok < total else 0.0)
        phase("stop", "SIGTERM to the process group, waiting for the pool dump")
        s0 = time.monotonic()
        stop = proc.stop(ctx.stop_grace_s)
        stop_s = time.monotonic() - s0
    finally:
        try:
            proc.stop(ctx.stop_grace_s)  # idempotent; runs on Ctrl-C too
        finally:
            sampled = sampler.stop()
    consume(collector.poll(final=True))
    if failure is not None and not seen and (refusal := device_busy(log_path)) is not None:
        raise refusal
    phase("scan", collector.where())
    collected = collector.collect()
    (folder / "scan.json").write_text(json.dumps(collected.doc, indent=2) + "\n", "utf-8")
    outcome = outcome_of(
        n,
        settings,
        collected.scan,
        Exercised(ok, total, dropped, first_error),
        failure=failure,
        graceful=stop.graceful,
        init_free_mib=[*free, *collected.init_free_mib],
        log_path=log_path,
        problem=collected.problem,
        worst_node=collected.worst_node,
        rank_peaks_mib=collected.rank_peaks_mib,
        times=(ready_s, request_s, stop_s, time.monotonic() - t0),
        exited=exited,
    )
    return replace(outcome, device_peaks_mib=sampled.peaks_mib, device_reader=sampled.reader,
                   notes=outcome.notes + ((sampled.failure,) if sampled.failure else ()))


def outcome_of(
    n: int,
    settings: LaunchSettings,
    scan: ScanResult,
    done: Exercised,
    *,
    failure: ServerFailedError | None,
    graceful: bool,
    init_free_mib: list[int],
    log_path: Path,
    problem: str | None,
    worst_node: str | None,
    rank_peaks_mib: dict[str, int],
    times: tuple[float, float, float, float],
    exited: int | None = None,
) -> LaunchOutcome:
    """Classify a finished launch from its scanned logs and what its requests got."""
    kind = _classify(scan, settings, failure, done.ok, done.total, done.dropped)
    if kind is None:
        raise _fatal(failure, graceful, log_path, scan)
    if kind is OutcomeKind.OK and problem:
        raise ServerFailedError(problem, log_path=str(log_path))
    ready_s, request_s, stop_s, total_s = times
    first_oom = scan.oom[0].text if scan.oom else None
    return LaunchOutcome(
        n=n,
        settings=settings,
        kind=kind,
        worst_peak_mib=scan.worst.actual_peak_mib if scan.worst else None,
        rank_peaks_mib=rank_peaks_mib,
        oom_text=first_oom,
        requests_ok=done.ok,
        requests_total=done.total,
        ready_s=round(ready_s, 3),
        request_s=round(request_s, 3),
        stop_s=round(stop_s, 3),
        total_s=round(total_s, 3),
        overhead_s=round(max(0.0, total_s - ready_s - request_s - stop_s), 3),
        log_path=str(log_path),
        device_free_mib=_device_free_mib(scan, init_free_mib),
        estimated_max_len=_estimated_max_len(scan),
        request_error=done.error,
        worst_node=worst_node,
        weights_gib=scan.weights_gib,
        oom_alloc_bytes=max((o.event.alloc_bytes or 0 for o in scan.oom), default=0) or None,
        requests_dropped=max(done.dropped, scan.prompts_ignored_total),
        notes=tuple(t.describe() for t in scan.truncated),  # also in scan.json's "truncated"
        server_exit_code=exited,
    )


def _describe(s: LaunchSettings) -> str:
    return (
        f"util {s.util:g}, model-use {s.model_use_gib} GiB, max_model_len {s.max_model_len:,}, "
        f"max-num-seqs {s.max_num_seqs}"
    )


@dataclass(frozen=True, slots=True)
class _Exercised:
    ok: int
    total: int
    dropped: int  # answered 200 without generating a token: the prompt never ran
    error: str | None


def workload(s: LaunchSettings, decode_tokens: int) -> tuple[int, int, int]:
    """(requests, prompt tokens each, tokens to generate each) of a launch's exercise."""
    if s.purpose is Purpose.PRERUN:
        return 1, probe.max_length_prompt_len(s.max_model_len, 1), 1
    decode = min(decode_tokens, max(1, s.max_model_len // 2))
    return s.max_num_seqs, probe.max_length_prompt_len(s.max_model_len, decode), decode


def tally(outs: Sequence[probe.CompletionOutcome], prompt_len: int) -> Exercised:
    """Count what really ran: a reply must carry a generated token for a prompt of the length
    sent (`usage`): vLLM drops a prompt its KV cache cannot admit and still answers 200."""
    dropped = [o for o in outs if o.ok and o.completion_tokens == 0]
    short = [o for o in outs if o.ok and o.completion_tokens != 0 and o.prompt_tokens is not None
             and o.prompt_tokens != prompt_len]
    failed = [o for o in outs if not o.ok]
    error = _describe_failure(*failed[:1])
    if short and error is None:
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


def _exercise(s: LaunchSettings, ctx: LaunchContext, base: str, phase: Phase) -> Exercised:
    """The pre-run's one max-length request, or the validation's full concurrent load."""
    count, plen, gen = workload(s, ctx.decode_tokens)
    if s.purpose is Purpose.PRERUN:
        prompt = probe.probe_prompt(plen, ctx.seed)
        phase("probe", f"one request of {plen + 1:,} tokens")
        outs: tuple[probe.CompletionOutcome, ...] = (
            probe.complete(base, ctx.served_name, prompt, 1, ctx.request_timeout_s),
        )
    else:
        phase("load", f"{count} concurrent requests of {plen + gen:,} tokens")
        outs = probe.load(
            base, ctx.served_name, count, plen, gen, ctx.seed, ctx.request_timeout_s
        ).outcomes
    return tally(outs, plen)


def _describe_failure(*outcomes: probe.CompletionOutcome) -> str | None:
    for o in outcomes:
        if not o.ok:
            return f"HTTP {o.status}: {o.error}" if o.status else str(o.error)
    return None


def _classify(
    scan: ScanResult,
    s: LaunchSettings,
    failure: ServerFailedError | None,
    ok: int,
    total: int,
    dropped: int = 0,
) -> OutcomeKind | None:
    """The outcome's kind, or None when nothing explains a failure (fatal for the run)."""
    kinds = [o.kind.name for o in scan.oom]
    for name, outcome in _START_KINDS.items():
        if name in kinds:
            return outcome
    if kinds:  # a device OOM: at start if the server never answered, else in a request
        if total:
            return OutcomeKind.OOM_IN_REQUEST
        # vLLM prints how long the weights took once they are in: before that line, the
        # weights themselves did not fit.
        return OutcomeKind.OOM_AT_START if scan.weights_gib else OutcomeKind.OOM_WEIGHTS
    if failure is not None:
        return None
    if dropped or (s.purpose is Purpose.PRERUN and scan.prompts_ignored):
        return OutcomeKind.PROMPT_DROPPED
    if total and ok < total:
        return OutcomeKind.REQUESTS_FAILED
    if scan.worst is None or scan.worst.actual_peak_mib is None:
        return None
    return OutcomeKind.OK


def _fatal(
    failure: ServerFailedError | None, graceful: bool, log_path: Path, scan: ScanResult
) -> ServerFailedError:
    if failure is not None:
        return failure
    tail = read_tail(log_path, 15)
    why = (
        "it did not exit within the grace period and was killed, so MindSpore printed nothing"
        if not graceful
        else "its log has no `actual peak used` line"
    )
    if scan.truncated:
        killed = ", killed after the grace period" if not graceful else ""
        why = f"{scan.truncated_total} cut short{killed}; first: {scan.truncated[0].describe()}"
    return ServerFailedError(
        f"the server stopped without a {'complete ' if scan.truncated else ''}memory-pool "
        f"dump: {why}",
        hint=f"check that GLOG_v=1 reaches the server; log {log_path}"
        + (f"\nlast log lines:\n{tail}" if tail else ""),
        log_path=str(log_path),
    )


def _device_free_mib(scan: ScanResult, init_free: list[int]) -> int | None:
    """The card's free memory as MindSpore measured it: its init line, or the upper bound of
    the max_device_memory range it printed when it refused the pool."""
    for record in scan.oom:
        limit = record.event.max_device_memory_limit_mib
        if limit:
            return int(limit)
    return min(init_free) if init_free else None


def _estimated_max_len(scan: ScanResult) -> int | None:
    for record in scan.oom:
        if record.event.estimated_max_model_len:
            return record.event.estimated_max_model_len
    return None
