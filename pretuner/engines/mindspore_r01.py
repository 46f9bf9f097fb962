"""The vLLM-MindSpore r0.1 engine's verdict on a launch: MindSpore's pool dump is the
measurement, its OOM texts and vLLM 0.6.6's refusals are the failure classes."""

from __future__ import annotations

from pathlib import Path

from pretuner.errors import ServerFailedError
from pretuner.launch.process import read_tail
from pretuner.logscan import ScanResult
from pretuner.tune.outcome import Exercised, LaunchOutcome, OutcomeKind
from pretuner.tune.settings import LaunchSettings, Purpose

_START_KINDS = {
    "KV_BLOCKS_EXHAUSTED": OutcomeKind.KV_EXHAUSTED,
    "MAX_DEVICE_MEMORY_RANGE": OutcomeKind.DEVICE_REFUSED,
    "MAX_MODEL_LEN_TOO_LARGE": OutcomeKind.LEN_TOO_LARGE,
}


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
