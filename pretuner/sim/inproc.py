"""The emulated server run in this process, stepping its scheduler synchronously.

Same command line, environment, boot sequence, scheduler, memory accounting and log lines as
`pretuner sim serve`; no process, no HTTP, no clocks. A benchmark scores thousands of tuning
runs this way in seconds, and decision tests drive the tuner against the emulated card in
milliseconds. `tests/test_run_sim.py` and `scripts/bench_tune.py --subprocess` check it
against the real subprocess server.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pretuner.sim.argv import UsageError
from pretuner.sim.engine import EngineLimits, OutOfMemory, check_step, log_oom
from pretuner.sim.r01_checks import StartupFailed
from pretuner.sim.r01_config import parse
from pretuner.sim.scheduler import Scheduler, Seq
from pretuner.sim.serve import Server

MAX_STEPS = 10_000_000


@dataclass(frozen=True, slots=True)
class Reply:
    """What one completion request got, as the HTTP client would see it."""

    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class InprocRun:
    log: str  # everything the server printed (stdout and stderr together)
    replies: tuple[Reply, ...]
    ready: bool  # it reached the point where the real server opens its socket
    exit_code: int
    # What a device reader sampling the server's cards would have seen at most, and their
    # total (npu-smi's HBM figures, the other tenant included); 0 when it never took a pool.
    device_peak_mib: int = 0
    device_total_mib: int = 0


def run(argv: Sequence[str], env: dict[str, str], prompts: Sequence[int],
        max_tokens: int) -> InprocRun:
    """Boot the emulated server, send `prompts` (their lengths) at once, stop it gracefully."""
    stream = io.StringIO()
    try:
        cfg = parse(list(argv), {**os.environ, **env})
    except UsageError as err:
        return InprocRun(f"pretuner sim serve: error: {err}\n", (), False, 2)
    server = Server(cfg, stream)
    try:
        limits = server.boot()
    except (StartupFailed, OutOfMemory) as err:
        code = server.failed_start(err)  # the traceback first, then the log is complete
        return InprocRun(stream.getvalue(), (), False, code, *_device(server))
    assert limits is not None  # noqa: S101 - no signal reaches an in-process server
    replies, crashed = _serve(server, limits, prompts, max_tokens)
    if crashed:
        server.card.unpublish()
        return InprocRun(stream.getvalue(), replies, True, 1, *_device(server))
    server._graceful(None)
    return InprocRun(stream.getvalue(), replies, True, 0, *_device(server))


def _device(server: Server) -> tuple[int, int]:
    """(peak, total) MiB of the server's cards as the emulated npu-smi shows them."""
    peak = server.card.peak_mib
    if peak == 0:
        return 0, 0
    return peak + server.cfg.occupied_mib, server.profile.total_mib


def _serve(server: Server, limits: EngineLimits, prompts: Sequence[int],
           max_tokens: int) -> tuple[tuple[Reply, ...], bool]:
    out: dict[str, Reply] = {}
    ids = [f"cmpl-{i}" for i in range(len(prompts))]
    sched = Scheduler(limits.scheduler())
    for rid, n in zip(ids, prompts, strict=True):
        if n + max_tokens > limits.max_model_len:
            out[rid] = Reply(400, None, None, "maximum context length exceeded")
            continue
        sched.add(Seq(rid, n, max_tokens))
    seqs = {s.request_id: s for s in sched.waiting}
    for _ in range(MAX_STEPS):
        if sched.idle:
            break
        plan = sched.plan()
        for ignored in plan.ignored:
            server.vlog.warning("scheduler.py:1097", ignored.warning)
            out[ignored.seq.request_id] = Reply(200, ignored.seq.prompt_len, 0)
        if plan.empty:
            if not plan.ignored:  # a bug, not a case: a real server would wait forever
                raise RuntimeError("the emulated scheduler made no progress")
            continue
        try:
            check_step(server.pools, limits.pool_cap_bytes, plan.prefill_shape(), plan.running)
        except OutOfMemory as oom:
            pool = server.pools[oom.rank]
            log_oom(pool.log, oom, pool.stats(), server.cfg.pool_format)
            server.print_crash(oom)
            for rid in ids:
                out.setdefault(rid, Reply(500, None, None, "Internal Server Error"))
            return tuple(out[rid] for rid in ids), True
        for seq in sched.commit(plan):
            out[seq.request_id] = Reply(200, seq.prompt_len, seq.generated)
    for rid in ids:
        if rid not in out:
            s = seqs[rid]
            out[rid] = Reply(200, s.prompt_len, s.generated)
    return tuple(out[rid] for rid in ids), False
