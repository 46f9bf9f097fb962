"""The emulated vLLM 0.24 server run in this process: no subprocess, no HTTP, no sleeping.

Same command line, environment, boot sequence, scheduler, memory accounting and log lines as
`python -m pretuner.sim vllm serve` (the code is shared); a benchmark scores thousands of
tuning runs this way, and tests replay the real H100 runs in milliseconds. Other emulated
servers' state files are not read: an in-process run is alone on its emulated GPUs (the tenant
of `PRETUNER_SIM_OCCUPIED_MIB` still counts).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pretuner.sim.inproc import Reply
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.boot import boot
from pretuner.sim.v1.config import UsageError, V1Config, parse
from pretuner.sim.v1.engine import EngineCore, print_fatal
from pretuner.sim.v1.http import length_error
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.sim.v1.scheduler import Req
from pretuner.sim.v1.server import CORE_PID_OFFSET, devices_for, print_ready, print_shutdown
from pretuner.units import MIB

MAX_STEPS = 10_000_000


@dataclass(frozen=True, slots=True)
class V1InprocRun:
    log: str  # everything the server printed
    replies: tuple[Reply, ...]  # `first` (when given), then `prompts`, in order
    ready: bool  # it reached the point where the real server opens its socket
    exit_code: int
    peaks_mib: dict[str, int]  # phase -> worst device's NVML used MiB
    total_mib: int  # the GPU's NVML total
    # The emulated card's clock (simulated seconds): the `first` request's time to its first
    # token and from its first to its last token, and the load's duration and tokens.
    first_ttft_s: float | None = None
    first_decode_s: float | None = None
    load_s: float | None = None
    load_tokens: int = 0


@dataclass
class _Recorder:
    """The boot Sink of an in-process run: tracks each phase's peak, never sleeps."""

    log: L.V1Log
    floor_mib: int  # NVML used without this process (idle + tenant)
    phase: str = "start"
    peaks: dict[str, int] = field(default_factory=dict)

    def level(self, process_bytes: int) -> None:
        used = self.floor_mib + -(-process_bytes // MIB)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), used)

    def pause(self, seconds: float) -> None:
        return


class _Client:
    """The HTTP side, reduced to what a reply and an access line are."""

    def __init__(self, log: L.V1Log) -> None:
        self.log = log
        self.port = 40000

    def reply(self, status: int, prompt: int | None = None, completion: int | None = None,
              error: str | None = None) -> Reply:
        self.port += 1
        phrase = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}[status]
        self.log.uvicorn(f'127.0.0.1:{self.port} - "POST /v1/completions HTTP/1.1" {status} '
                         f"{phrase}")
        return Reply(status, prompt, completion, error)


@dataclass
class _Times:
    """The emulated clock of one burst: when it ended, each request's first and last token."""

    step_s: Callable[[int], float]
    now: float = 0.0
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)


def _drive(core: EngineCore, rec: _Recorder, client: _Client, lens: Sequence[int],
           max_tokens: int, mml: int, times: _Times) -> list[Reply]:
    """Send these prompts at once and step until all are answered."""
    replies: dict[int, Reply] = {}
    reqs: dict[str, int] = {}
    for i, n in enumerate(lens):
        why = length_error(mml, n, max_tokens)
        if why is not None:
            replies[i] = client.reply(400, error=why)
        elif core.dead is not None:
            replies[i] = client.reply(500, error=L.ENGINE_DEAD)
        else:
            req = Req(f"cmpl-{rec.phase}-{i}", n, max_tokens)
            reqs[req.request_id] = i
            core.sched.add(req)
    for _ in range(MAX_STEPS):
        result = core.step()
        if result is None:
            break
        rec.level(result.peak_bytes)
        if result.oom is not None:
            print_fatal(rec.log, core, result)
            break
        times.now += times.step_s(result.tokens)
        for req in result.sampled:
            i = reqs[req.request_id]
            times.first.setdefault(i, times.now)
            times.last[i] = times.now
        for req in result.finished:
            replies[reqs[req.request_id]] = client.reply(200, req.prompt_len, req.generated)
    for i in range(len(lens)):
        if i not in replies:
            replies[i] = client.reply(500, error=L.ENGINE_DEAD)
    return [replies[i] for i in range(len(lens))]


def run(argv: Sequence[str], env: dict[str, str], prompts: Sequence[int], max_tokens: int,
        *, first: int | None = None) -> V1InprocRun:
    """Boot, send `first` alone (when given) then `prompts` at once, stop with SIGTERM.

    `argv` is what follows `vllm serve`; `env` is laid over this process's environment.
    """
    stream = io.StringIO()
    try:
        cfg: V1Config = parse(list(argv), {**os.environ, **env})
    except UsageError as err:
        return V1InprocRun(f"vllm serve: error: {err}\n", (), False, 2, {}, 0)
    profile = CUDA_PROFILES[cfg.profile]
    log = L.V1Log(os.getpid(), os.getpid() + CORE_PID_OFFSET, stream)
    rec = _Recorder(log, profile.idle_mib + cfg.occupied_mib)
    total = profile.nvml_total_mib
    if devices_for(cfg) is None:
        log.raw(L.API, ["ValueError: The number of required GPUs exceeds the total number of "
                        "available GPUs in the placement group."])
        return V1InprocRun(stream.getvalue(), (), False, 1, {"stop": rec.floor_mib}, total)
    booted = boot(cfg, rec)
    if booted is None:
        rec.peaks["stop"] = rec.floor_mib
        return V1InprocRun(stream.getvalue(), (), False, 1, dict(rec.peaks), total)
    core = EngineCore(booted, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    print_ready(log, cfg.host or "0.0.0.0", cfg.port)  # noqa: S104 - the address it would print
    client = _Client(log)
    replies: list[Reply] = []
    clock = booted.clock
    step_s = clock.step_seconds if clock is not None else (lambda tokens: 0.0)
    ttft = decode = None
    if first is not None:
        rec.phase = "probe"
        rec.level(core.level_bytes)
        one = _Times(step_s)
        replies += _drive(core, rec, client, [first], max_tokens, booted.max_model_len, one)
        if 0 in one.first:
            ttft, decode = one.first[0], one.last[0] - one.first[0]
    rec.phase = "load"
    rec.level(core.level_bytes)
    burst = _Times(step_s)
    replies += _drive(core, rec, client, prompts, max_tokens, booted.max_model_len, burst)
    generated = sum(r.completion_tokens or 0 for r in replies[len(replies) - len(prompts):]
                    if r.status == 200)
    rec.phase = "stop"
    rec.level(core.level_bytes)
    print_shutdown(log, "SIGTERM")
    for line in ("Shutting down", "Waiting for application shutdown.",
                 "Application shutdown complete."):
        log.uvicorn(line)
    return V1InprocRun(stream.getvalue(), tuple(replies), True, 0, dict(rec.peaks), total,
                       ttft, decode, burst.now, generated)
