"""One launch, start to finish: start the server, probe or load it, stop it gracefully, scan
its log, and say what happened in one classified outcome."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from pretuner.errors import ServerFailedError
from pretuner.launch import probe
from pretuner.launch.process import ServerProcess, read_tail
from pretuner.logscan import Located, OomEvent, OomKind, ScanResult
from pretuner.logscan.lines import DeviceMemoryInit
from pretuner.tune.collect import CollectorFactory, LocalCollector
from pretuner.tune.record import RunRecord
from pretuner.tune.settings import LaunchCommand, LaunchSettings, Purpose, redact_env

log = logging.getLogger(__name__)

Phase = Callable[[str, str], None]  # (phase, detail) -> None, for the progress display


class OutcomeKind(str, Enum):
    OK = "ok"
    OOM_AT_START = "oom_at_start"  # weights + warm-up did not fit in model-use
    OOM_IN_REQUEST = "oom_in_request"  # activation of the probe/load did not fit
    KV_EXHAUSTED = "kv_blocks_exhausted"  # KV blocks <= 0 at start
    DEVICE_REFUSED = "device_memory_refused"  # card*util above the card's free memory
    LEN_TOO_LARGE = "max_model_len_too_large"  # max_model_len above the KV token count
    REQUESTS_FAILED = "requests_failed"  # requests failed without any OOM line


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
        return cls(**fields_)


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
    (folder / "command.json").write_text(
        json.dumps(
            {"argv": cmd.argv, "env": redact_env(cmd.env), "shell": cmd.shell_line()}, indent=2
        )
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
    ok = total = 0
    first_error: str | None = None
    failure: ServerFailedError | None = None
    phase("launch", f"{settings.purpose.value} {_describe(settings)}")
    proc = ServerProcess.start(cmd.argv, {**os.environ, **cmd.env}, log_path)
    try:
        try:
            phase("loading", f"waiting for {base}/health")
            w0 = time.monotonic()
            proc.wait_ready(f"{base}/health", ctx.ready_timeout_s, check=check)
            ready_s = time.monotonic() - w0
            phase("ready", f"after {ready_s:.1f} s")
            r0 = time.monotonic()
            ok, total, first_error = _exercise(settings, ctx, base, phase)
            request_s = time.monotonic() - r0
            with contextlib.suppress(_OomSeen):
                check()
        except _OomSeen:
            pass
        except ServerFailedError as err:
            failure = err
        phase("stop", "SIGTERM to the process group, waiting for the pool dump")
        s0 = time.monotonic()
        stop = proc.stop(ctx.stop_grace_s)
        stop_s = time.monotonic() - s0
    finally:
        proc.stop(ctx.stop_grace_s)  # idempotent; runs on Ctrl-C too
    consume(collector.poll(final=True))
    phase("scan", collector.where())
    collected = collector.collect()
    scan = collected.scan
    (folder / "scan.json").write_text(json.dumps(collected.doc, indent=2) + "\n", "utf-8")
    kind = _classify(scan, settings, failure, ok, total)
    if kind is None:
        raise _fatal(failure, stop.graceful, log_path)
    if kind is OutcomeKind.OK and collected.problem:
        raise ServerFailedError(collected.problem, log_path=str(log_path))
    free += collected.init_free_mib
    total_s = time.monotonic() - t0
    first_oom = scan.oom[0].text if scan.oom else None
    return LaunchOutcome(
        n=n,
        settings=settings,
        kind=kind,
        worst_peak_mib=scan.worst.actual_peak_mib if scan.worst else None,
        rank_peaks_mib=collected.rank_peaks_mib,
        oom_text=first_oom,
        requests_ok=ok,
        requests_total=total,
        ready_s=round(ready_s, 3),
        request_s=round(request_s, 3),
        stop_s=round(stop_s, 3),
        total_s=round(total_s, 3),
        overhead_s=round(max(0.0, total_s - ready_s - request_s - stop_s), 3),
        log_path=str(log_path),
        device_free_mib=_device_free_mib(scan, free),
        estimated_max_len=_estimated_max_len(scan),
        request_error=first_error,
        worst_node=collected.worst_node,
    )


def _describe(s: LaunchSettings) -> str:
    return (
        f"util {s.util:g}, model-use {s.model_use_gib} GiB, max_model_len {s.max_model_len:,}, "
        f"max-num-seqs {s.max_num_seqs}"
    )


def _exercise(
    s: LaunchSettings, ctx: LaunchContext, base: str, phase: Phase
) -> tuple[int, int, str | None]:
    """The pre-run's one max-length request, or the validation's full concurrent load."""
    if s.purpose is Purpose.PRERUN:
        prompt = probe.probe_prompt(probe.max_length_prompt_len(s.max_model_len, 1), ctx.seed)
        phase("probe", f"one request of {len(prompt) + 1:,} tokens")
        out = probe.complete(base, ctx.served_name, prompt, 1, ctx.request_timeout_s)
        return int(out.ok), 1, _describe_failure(out)
    decode = min(ctx.decode_tokens, max(1, s.max_model_len // 2))
    plen = probe.max_length_prompt_len(s.max_model_len, decode)
    phase("load", f"{s.max_num_seqs} concurrent requests of {plen + decode:,} tokens")
    res = probe.load(
        base, ctx.served_name, s.max_num_seqs, plen, decode, ctx.seed, ctx.request_timeout_s
    )
    failed = [o for o in res.outcomes if not o.ok]
    return len(res.outcomes) - len(failed), len(res.outcomes), _describe_failure(*failed[:1])


def _describe_failure(*outcomes: probe.CompletionOutcome) -> str | None:
    for o in outcomes:
        if not o.ok:
            return f"HTTP {o.status}: {o.error}" if o.status else str(o.error)
    return None


def _classify(
    scan: ScanResult, s: LaunchSettings, failure: ServerFailedError | None, ok: int, total: int
) -> OutcomeKind | None:
    """The outcome's kind, or None when nothing explains a failure (fatal for the run)."""
    kinds = [o.kind.name for o in scan.oom]
    for name, outcome in _START_KINDS.items():
        if name in kinds:
            return outcome
    if kinds:  # a device OOM: at start if the server never answered, else in a request
        return OutcomeKind.OOM_AT_START if total == 0 else OutcomeKind.OOM_IN_REQUEST
    if failure is not None:
        return None
    if total and ok < total:
        return OutcomeKind.REQUESTS_FAILED
    if scan.worst is None or scan.worst.actual_peak_mib is None:
        return None
    return OutcomeKind.OK


def _fatal(failure: ServerFailedError | None, graceful: bool, log_path: Path) -> ServerFailedError:
    if failure is not None:
        return failure
    tail = read_tail(log_path, 15)
    why = (
        "it did not exit within the grace period and was killed, so MindSpore printed nothing"
        if not graceful
        else "its log has no `actual peak used` line"
    )
    return ServerFailedError(
        f"the server stopped without a memory-pool dump: {why}",
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
