"""The emulated r0.1 server run in this process, stepping its engine synchronously.

Same command line, boot, scheduler, memory and log lines as `pretuner sim serve`; no process,
HTTP or clock. `tests/test_run_sim.py` checks it against the subprocess server."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from pretuner.sim.argv import Refused, UsageError
from pretuner.sim.engine import OutOfMemory, Request
from pretuner.sim.http import Reply
from pretuner.sim.r01_config import parse
from pretuner.sim.scheduler import SchedulerLimits
from pretuner.sim.serve import Server

MAX_STEPS = 10_000_000


@dataclass(frozen=True, slots=True)
class InprocRun:
    """What an in-process run of either personality gave (the clock figures: V1's only)."""

    log: str  # everything the server printed
    replies: tuple[Reply, ...]  # every phase's, in order
    ready: bool  # it reached the point where the real server opens its socket
    exit_code: int
    # phase -> the worst device's used MiB as its smi tool shows it (the tenant included), and
    # the device's total; none when the server never held memory.
    peaks_mib: dict[str, int] = field(default_factory=dict)
    total_mib: int = 0
    last_mib: dict[str, int] = field(default_factory=dict)  # phase -> used MiB at its end
    reset_status: int | None = None  # the last /reset_mm_cache's HTTP status
    # The emulated card's clock (simulated seconds): the `first` request's time to its first
    # token and from its first to its last token, and the load's duration and tokens.
    first_ttft_s: float | None = None
    first_decode_s: float | None = None
    load_s: float | None = None
    load_tokens: int = 0


def run(argv: Sequence[str], env: dict[str, str], prompts: Sequence[int],
        max_tokens: int) -> InprocRun:
    """Boot the emulated server, send `prompts` (their lengths) at once, stop it gracefully."""
    stream = io.StringIO()
    try:
        cfg = parse(list(argv), {**os.environ, **env})
    except UsageError as err:
        return InprocRun(f"pretuner sim serve: error: {err}\n", (), False, 2)
    server = Server(cfg, stream)
    replies: tuple[Reply, ...] = ()
    ready = False  # reached the point where the real server opens its socket
    try:
        limits = server.boot()
    except (Refused, OutOfMemory) as err:
        code = server.failed_start(err)  # the traceback first, then the log is complete
    else:
        assert limits is not None  # noqa: S101 - no signal reaches an in-process server
        ready = True
        replies, crashed = _serve(server, limits, prompts, max_tokens)
        code = 1 if crashed else server._graceful(None)
    # The peak and total MiB of the server's cards as the emulated npu-smi shows them.
    peak = {"run": server.peak_mib + cfg.occupied_mib} if server.peak_mib else {}
    return InprocRun(stream.getvalue(), replies, ready, code, peak,
                     server.profile.total_mib if peak else 0)


def _serve(server: Server, limits: SchedulerLimits, prompts: Sequence[int],
           max_tokens: int) -> tuple[tuple[Reply, ...], bool]:
    """The server's engine stepped in this process until every request is answered."""
    engine = server._engine(limits)  # not started: stepped below
    reqs = [Request(f"cmpl-{i}", n, max_tokens) for i, n in enumerate(prompts)]
    for req in reqs:
        if req.prompt_len + max_tokens <= limits.max_model_len:
            engine.submit(req)
    crashed = False
    for _ in range(MAX_STEPS):
        if engine.sched.idle:
            break
        plan = engine.plan()
        if plan.empty:
            if not plan.ignored:  # a bug, not a case: a real server would wait forever
                raise RuntimeError("the emulated scheduler made no progress")
            continue
        if not engine.check(plan):
            server.print_crash(engine.dead)
            server.files.remove()
            crashed = True
            break
        engine.advance(plan)
    return tuple(_reply(r, limits.max_model_len) for r in reqs), crashed


def _reply(req: Request, max_model_len: int) -> Reply:
    if req.prompt_len + req.max_tokens > max_model_len:
        return Reply(400, None, None, "maximum context length exceeded")
    if req.error is not None:
        return Reply(500, None, None, "Internal Server Error")
    return Reply(200, req.prompt_len, len(req.output))
