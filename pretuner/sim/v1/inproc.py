"""The emulated vLLM 0.24 server run in this process: no subprocess, no HTTP, no sleeping.

Same command line, boot, scheduler, memory and log lines as `python -m pretuner.sim vllm
serve` (the code is shared). An in-process run is alone on its emulated GPUs: other servers'
state files are not read (the `PRETUNER_SIM_OCCUPIED_MIB` tenant still counts)."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pretuner.launch.images import LoadPhase, MMRequest, Request, TextRequest
from pretuner.sim.argv import UsageError
from pretuner.sim.http import ANY_HOST, Reply, access_line
from pretuner.sim.inproc import InprocRun
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.boot import Sink, boot
from pretuner.sim.v1.chat import prompt_of, too_many_images
from pretuner.sim.v1.config import V1Config, parse
from pretuner.sim.v1.engine import EngineCore
from pretuner.sim.v1.http import length_error
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.sim.v1.mm import MMItem
from pretuner.sim.v1.scheduler import Req
from pretuner.sim.v1.server import (
    CORE_PID_OFFSET,
    DEV_MODE_ENV,
    print_ready,
    print_shutdown,
    print_stopped,
)

MAX_STEPS = 10_000_000


def _prompt(r: Request) -> tuple[int, tuple[MMItem, ...]]:
    """A `pretuner.launch.images` request's prompt length and images, as this server sees it."""
    if isinstance(r, MMRequest):
        p = prompt_of(r)
        return p.prompt_len, p.images
    return r.prompt_len, ()


def waves_of(phases: Sequence[LoadPhase]) -> list[LoadPhase]:
    """The phases, each that resets followed by an empty "reset" one: its own phase, as the
    tuner samples the device after the reset."""
    waves: list[LoadPhase] = []
    for p in phases:
        waves += [p, LoadPhase("reset", ())] if p.reset else [p]
    return waves


class Client:
    """The HTTP side, reduced to what a reply and an access line are."""

    def __init__(self, log: L.V1Log, dev_mode: bool = False) -> None:
        self.log = log
        self.port = 40000
        self.dev_mode = dev_mode  # VLLM_SERVER_DEV_MODE=1: /reset_mm_cache is served

    def reply(self, status: int, prompt: int | None = None, completion: int | None = None,
              error: str | None = None, path: str = "/v1/completions") -> Reply:
        self.port += 1
        self.log.uvicorn(access_line("127.0.0.1", self.port, "POST", path, status))
        return Reply(status, prompt, completion, error)


@dataclass
class Times:
    """The emulated clock of one burst: when it ended, each request's first and last token."""

    step_s: Callable[[int], float]
    now: float = 0.0
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)


def _refused(core: EngineCore, client: Client, req: Req) -> Reply | None:
    """The answer a request gets without running: too long, images over the limit, dead."""
    path = "/v1/chat/completions" if req.mm else "/v1/completions"
    mm = core.mm
    why = length_error(core.b.max_model_len, req.prompt_len, req.max_tokens)
    if why is None and req.mm and (mm is None or len(req.mm) > mm.card.image_limit):
        why = too_many_images(0 if mm is None else mm.card.image_limit, mm is not None)
    if why is not None:
        return client.reply(400, error=why, path=path)
    if core.dead is not None:
        return client.reply(500, error=L.ENGINE_DEAD, path=path)
    return None


def drive(core: EngineCore, rec: Sink, client: Client, wave: LoadPhase,
          times: Times) -> tuple[list[Reply], int | None]:
    """Send the wave's requests (all at once, or a closed loop) and step until answered,
    keeping the emulated clock in `times`."""
    replies: dict[int, Reply] = {}
    reqs: dict[str, int] = {}
    todo = list(enumerate(wave.requests))
    limit = wave.concurrency or len(todo)

    def feed() -> None:
        while todo and len(reqs) < limit:
            i, r = todo.pop(0)
            prompt_len, images = _prompt(r)
            req = Req(f"cmpl-{rec.phase}-{i}", prompt_len, r.max_tokens, mm=images)
            refused = _refused(core, client, req)
            if refused is not None:
                replies[i] = refused
                continue
            reqs[req.request_id] = i
            core.add(req)

    feed()
    for _ in range(MAX_STEPS):
        result = core.step()
        if result is None:
            break
        rec.level(result.peak_bytes)
        if core.dead is not None:
            break
        times.now += times.step_s(result.tokens)
        for req in result.sampled:
            i = reqs[req.request_id]
            times.first.setdefault(i, times.now)
            times.last[i] = times.now
        for req in result.finished:
            i = reqs.pop(req.request_id)
            path = "/v1/chat/completions" if req.mm else "/v1/completions"
            replies[i] = client.reply(200, req.prompt_len, req.generated, path=path)
        feed()
        rec.level(core.level_bytes)
    for i in range(len(wave.requests)):
        if i not in replies:
            replies[i] = client.reply(500, error=L.ENGINE_DEAD)
    status = None
    if wave.reset:
        status = 200 if client.dev_mode else 404
        if core.dead is None and core.mm is not None and client.dev_mode:
            core.mm.reset()
        rec.log.uvicorn(access_line("127.0.0.1", 40000, "POST", "/reset_mm_cache", status))
    return [replies[i] for i in range(len(wave.requests))], status


def run(argv: Sequence[str], env: dict[str, str], prompts: Sequence[int], max_tokens: int,
        *, first: int | None = None, burst: tuple[TextRequest, ...] = ()) -> InprocRun:
    """Boot, send `first` alone (when given), then `prompts` at once, then `burst` at once,
    stop with SIGTERM."""
    waves = [LoadPhase("probe", (TextRequest(first, max_tokens),))] if first is not None else []
    waves.append(LoadPhase("load", tuple(TextRequest(n, max_tokens) for n in prompts)))
    if burst:
        waves.append(LoadPhase("burst", burst))
    return run_waves(argv, env, waves)


def run_waves(argv: Sequence[str], env: dict[str, str],
              waves: Sequence[LoadPhase]) -> InprocRun:
    """Boot, send each wave in its own phase, stop with SIGTERM."""
    stream = io.StringIO()
    try:
        cfg: V1Config = parse(list(argv), {**os.environ, **env})
    except UsageError as err:
        return InprocRun(f"vllm serve: error: {err}\n", (), False, 2)
    profile = CUDA_PROFILES[cfg.profile]
    log = L.V1Log(os.getpid(), os.getpid() + CORE_PID_OFFSET, stream)
    rec = Sink(log, profile.idle_mib + cfg.occupied_mib)
    total = profile.nvml_total_mib
    booted = boot(cfg, rec)
    if booted is None:
        rec.peaks["stop"] = rec.floor_mib
        return InprocRun(stream.getvalue(), (), False, 1, dict(rec.peaks), total)
    core = EngineCore(booted, log)
    print_ready(log, cfg.host or ANY_HOST, cfg.port)
    client = Client(log, cfg.env.get(DEV_MODE_ENV) == "1")
    replies: list[Reply] = []
    step_s = booted.clock.step_seconds
    timing: dict[str, tuple[Times, list[Reply]]] = {}
    reset: int | None = None
    for wave in waves:
        rec.phase = wave.name
        rec.level(core.level_bytes)
        times = Times(step_s)
        got, status = drive(core, rec, client, wave, times)
        timing[wave.name] = (times, got)
        replies += got
        reset = status if status is not None else reset
        rec.level(core.level_bytes)
    ttft = decode = load_s = None
    generated = 0
    if "probe" in timing and 0 in timing["probe"][0].first:
        one = timing["probe"][0]
        ttft, decode = one.first[0], one.last[0] - one.first[0]
    if "load" in timing:
        burst, got = timing["load"]
        load_s = burst.now
        generated = sum(r.completion_tokens or 0 for r in got if r.status == 200)
    rec.phase = "stop"
    rec.level(core.level_bytes)
    print_shutdown(log, "SIGTERM")
    print_stopped(log)
    return InprocRun(stream.getvalue(), tuple(replies), True, 0, dict(rec.peaks), total,
                       dict(rec.last), reset, first_ttft_s=ttft, first_decode_s=decode,
                       load_s=load_s, load_tokens=generated)
