"""The vLLM-MindSpore r0.1 engine: the command and environment of a launch (pure data), and its
verdict on a launch (MindSpore's pool dump is the measurement, its OOM texts and vLLM 0.6.6's
refusals are the failure classes)."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

from pretuner.emulation import emulator
from pretuner.engines.base import LaunchCommand, LaunchSettings, Purpose
from pretuner.engines.outcome import Exercised, LaunchOutcome, OutcomeKind
from pretuner.errors import ServerFailedError
from pretuner.launch.process import read_tail
from pretuner.logscan import ScanResult


class Backend(str, Enum):
    SIM = "sim"
    VLLM_MINDSPORE = "vllm-mindspore"
    MINDSPORE_CPU = "mindspore-cpu"


R01_COMMAND = ("python3", "-m", "vllm_mindspore.entrypoints", "vllm.entrypoints.openai.api_server")
V03_COMMAND = ("vllm-mindspore", "serve")


def default_serve_command(backend: Backend, engine_version: str | None) -> tuple[list[str], bool]:
    """The server command for a backend, and whether the model goes as `--model` (r0.1 style)."""
    if backend is Backend.SIM:
        return emulator().server_command("r01"), True
    if backend is Backend.MINDSPORE_CPU:
        return emulator().server_command("mindspore-cpu"), True
    if engine_version is not None and _version_tuple(engine_version) >= (0, 3):
        return list(V03_COMMAND), False
    return list(R01_COMMAND), True


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def build_launch(
    s: LaunchSettings,
    *,
    base_command: list[str],
    model_as_flag: bool,
    model: str,
    served_name: str,
    host: str,
    port: int,
    nodes: int = 1,
    extra_env: dict[str, str] | None = None,
) -> LaunchCommand:
    """The exact argv and environment of one launch."""
    argv = list(base_command)
    argv += ["--model", model] if model_as_flag else [model]
    argv += [
        "--host", host,
        "--port", str(port),
        "--served-model-name", served_name,
        "--max-model-len", str(s.max_model_len),
        "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens),
        "--gpu-memory-utilization", f"{s.util:g}",
        "--block-size", str(s.block_size),
        "--tensor-parallel-size", str(s.tp),
    ]  # fmt: skip
    if s.pp > 1:
        argv += ["--pipeline-parallel-size", str(s.pp)]
    argv += engine_prefill_flags(s.max_model_len, s.chunked_prefill)
    dtype = server_kv_cache_dtype(s.kv_cache_dtype)
    if dtype is not None:
        argv += ["--kv-cache-dtype", dtype]
    if nodes > 1:
        argv += ["--distributed-executor-backend", "ray"]
    env = {
        "GLOG_v": "1",  # MindSpore prints the pool dump at INFO only
        "ASCEND_TOTAL_MEMORY_GB": str(s.card_gib),
        "vLLM_MODEL_MEMORY_USE_GB": str(s.model_use_gib),
    }
    env.update(extra_env or {})
    return LaunchCommand(argv=argv, env=env)


# vLLM 0.6 turns chunked prefill on by default above this max_model_len.
CHUNKED_BY_DEFAULT_ABOVE = 32768
# pretuner's KV dtype names -> the server's `--kv-cache-dtype` (None: the model's own dtype).
# MindSpore's int8 MLA layout (int8 latent, bf16 rope) is what vLLM-MindSpore's int8 means for
# an MLA model.
_SERVER_KV_DTYPE: dict[str, str | None] = {
    "auto": None, "bf16": None, "fp16": None, "int8": "int8", "int8-mla": "int8", "fp8": "fp8",
}


def server_kv_cache_dtype(kv_cache_dtype: str) -> str | None:
    """The `--kv-cache-dtype` value the server takes, or None to leave the flag out."""
    return _SERVER_KV_DTYPE.get(kv_cache_dtype, kv_cache_dtype)


def chunked_prefill_flag(max_model_len: int, chunked: bool) -> bool | None:
    """`--enable-chunked-prefill`'s value whenever the engine's default differs from the
    policy, else None (leave the flag out)."""
    if chunked:
        return True
    if max_model_len > CHUNKED_BY_DEFAULT_ABOVE:
        return False
    return None


def engine_prefill_flags(max_model_len: int, chunked: bool) -> list[str]:
    flag = chunked_prefill_flag(max_model_len, chunked)
    if flag is None:
        return []
    return ["--enable-chunked-prefill"] if flag else ["--enable-chunked-prefill", "False"]


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
