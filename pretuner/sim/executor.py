"""Launches on the emulated cards without processes: the same server code, run in this process.

Each executor serves a tuning loop (r0.1's `Tuner`, V1's `V1Tuner`): it builds each launch's
command exactly as a real run does, runs the emulated server in-process (`pretuner.sim.inproc`,
`pretuner.sim.v1.inproc`), writes its log to the launch folder and judges it as a real launch's.
Benchmarks and decision tests use them; `pretuner run` never does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pretuner.engines.base import Family, LaunchSettings, Purpose
from pretuner.engines.mindspore_r01 import SIM, outcome_of
from pretuner.engines.outcome import (
    BURST_OUTPUT_TOKENS,
    Executor,
    Exercised,
    LaunchOutcome,
    burst_shape,
    joined,
    tally,
    workload,
)
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import SOAK_PHASES, Soak
from pretuner.engines.v1_launch import V1Hooks, concurrency, unexplained_exit
from pretuner.launch.collect import rank_peaks
from pretuner.launch.images import LoadPhase, TextRequest, validation_phases, worst_case
from pretuner.launch.probe import CompletionOutcome
from pretuner.logscan import scan_paths
from pretuner.sim import inproc
from pretuner.sim.http import Reply
from pretuner.sim.plugin import EMULATOR
from pretuner.sim.v1 import inproc as v1_inproc
from pretuner.sim.v1.chat import TEMPLATE_TOKENS
from pretuner.speed import Speed
from pretuner.tune.entry import RunOptions
from pretuner.tune.execute import Phase
from pretuner.tune.pinned.loop import V1Config, V1Result, V1Tuner
from pretuner.tune.pinned.setup import pinned_setup
from pretuner.tune.r01.config import CardInfo, TuneResult
from pretuner.tune.r01.setup import Tuner, r01_setup

DECODE_TOKENS = 16


def _launch_log(workdir: Path, n: int, log: str) -> Path:
    folder = workdir / f"launch-{n}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "server.log"
    path.write_text(log, encoding="utf-8")
    return path


def _outcomes(replies: Sequence[Reply]) -> list[CompletionOutcome]:
    return [CompletionOutcome(r.status, r.status == 200, 0.0, r.prompt_tokens,
                              r.completion_tokens, r.error) for r in replies]


def tune_in_process(
    opts: RunOptions, workdir: Path, card: CardInfo | None = None, phase: Phase | None = None
) -> TuneResult:
    """The whole r0.1 loop against the emulated server run in this process."""
    choice = EngineChoice(SIM, Family.R01, True, None, "in-process emulated card")
    setup = r01_setup(opts, choice, card)
    build, decode_tokens = setup.ctx.build, setup.ctx.decode_tokens
    counter = itertools.count(1)

    def execute(settings: LaunchSettings) -> LaunchOutcome:
        n = next(counter)
        t0 = time.monotonic()
        cmd = build(settings, 0)
        argv = EMULATOR.server_flags("r01", cmd.argv)
        count, plen, gen = workload(settings, decode_tokens)
        res = inproc.run(argv, cmd.env, [plen] * count, gen)
        log_path = _launch_log(workdir, n, res.log)
        scan = scan_paths([log_path])
        failure = None if res.ready or scan.oom else unexplained_exit(log_path, res.exit_code)
        outcome = outcome_of(
            n,
            settings,
            scan,
            tally(_outcomes(res.replies), plen),  # none when it never got ready
            failure=failure,
            graceful=res.exit_code == 0,
            init_free_mib=list(scan.init_free_mib),
            log_path=log_path,
            problem=None,
            worst_node=None,
            rank_peaks_mib=rank_peaks(scan),
            times=(0.0, 0.0, 0.0, time.monotonic() - t0),
        )
        if not res.peaks_mib:
            return outcome
        # What the sampler of a real run reads from the emulated npu-smi.
        return replace(outcome, device_peaks_mib=dict(res.peaks_mib),
                       device_reader="emulated npu-smi (in process)",
                       device_total_mib=res.total_mib)

    return Tuner(setup.cfg, execute, phase or (lambda p, d: None)).run()


def soak_answered(phases: list[LoadPhase], outs: list[CompletionOutcome]) -> int:
    """How many of the soak's requests were answered 200 (replies come in phase order)."""
    replies = iter(outs)
    return sum(o.ok for p in phases for o in itertools.islice(replies, len(p.requests))
               if p.name in SOAK_PHASES)


def emulated_speed(res: inproc.InprocRun, s: LaunchSettings,
                   prompt_len: int | None) -> Speed | None:
    """A validation's speed on the emulated card's own clock (the lone request, the burst);
    None for a pre-run and for image requests (their length is the server's count)."""
    if s.purpose is Purpose.PRERUN or prompt_len is None or res.first_ttft_s is None \
            or not res.replies:
        return None
    first = res.replies[0]
    burst = res.replies[1:]
    return Speed(prompt_tokens=prompt_len, ttft_s=round(res.first_ttft_s, 4),
                 decode_tokens=max(0, (first.completion_tokens or 1) - 1),
                 decode_s=round(res.first_decode_s or 0.0, 4), load_requests=len(burst),
                 load_tokens=res.load_tokens,
                 load_s=round(res.load_s, 4) if res.load_s else None, how="emulated clock")


def tune_v1_in_process(opts: RunOptions, workdir: Path, phase: Phase | None = None) -> V1Result:
    """The whole V1 loop against the emulated V1 server run in this process (benchmarks,
    tests): the same setup, loop and judge as `pretuner run --engine vllm`; a vision-language
    model's launches get `pretuner.engines.v1_images`' requests, with the emulator's own chat
    template (what the HTTP path calibrates)."""
    cfg, execute = v1_in_process(opts, workdir)
    return V1Tuner(cfg, execute, phase or (lambda p, d: None)).run()


def v1_in_process(opts: RunOptions, workdir: Path) -> tuple[V1Config, Executor]:
    """The V1 method's configuration for `opts`, and an executor of its launches in-process."""
    choice = EngineChoice(opts.engine, Family.V1, True, None, "in-process emulated V1 server")
    setup = pinned_setup(opts, choice)
    build, bytes_per_token = setup.ctx.build, setup.cfg.bytes_per_token
    images, seed = setup.vision.images, opts.seed
    counter = itertools.count(1)
    soak = setup.vision.soak or Soak()
    hooks = V1Hooks(bytes_per_token, images, soak)
    shape = images if images is not None and not images.is_text_only else None

    def execute(s: LaunchSettings) -> LaunchOutcome:
        n = next(counter)
        t0 = time.monotonic()
        cmd = build(s, 0)
        argv = EMULATOR.server_flags("v1", cmd.argv)
        if argv[:1] == ["serve"]:
            argv = argv[1:]
        count = concurrency(s, None, bytes_per_token)
        _, plen, decode = workload(s, DECODE_TOKENS)  # a pre-run's: one token
        b = burst_shape(s, (s.kv_cache_bytes or 0) // bytes_per_token or None,
                        BURST_OUTPUT_TOKENS)
        burst = (TextRequest(b.prompt_len, b.max_tokens),) * b.requests
        phases: list[LoadPhase] = []
        if shape is not None and s.purpose is Purpose.PRERUN:
            req = worst_case(shape, s.max_model_len, 1, f"probe/{seed}", TEMPLATE_TOKENS)
            phases = [LoadPhase("probe", (req,)), LoadPhase("burst", burst)]
        elif shape is not None:
            phases = validation_phases(shape, s.max_model_len, decode, count, soak.planned, seed,
                                       TEMPLATE_TOKENS)
            phases.insert(2, LoadPhase("burst", burst))  # after "images", as the HTTP path
        if phases:
            res = v1_inproc.run_waves(argv, cmd.env, v1_inproc.waves_of(phases))
        elif s.purpose is Purpose.PRERUN:
            res = v1_inproc.run(argv, cmd.env, [plen], 1, burst=burst)
        else:
            res = v1_inproc.run(argv, cmd.env, [plen] * count, decode, first=plen, burst=burst)
        prompt_len = None if phases else plen  # an image request's length is the server's count
        log_path = _launch_log(workdir, n, res.log)
        outs = _outcomes(res.replies)
        failure = None if res.ready or "out of memory" in res.log.lower() \
            or "estimated maximum model length" in res.log \
            or "cache blocks" in res.log else unexplained_exit(log_path, res.exit_code)
        if not phases:  # the burst's prompts are short
            sent = 1 if s.purpose is Purpose.PRERUN else count + 1
            ran = joined(tally(outs[:sent], plen), tally(outs[sent:], b.prompt_len))
        else:
            ran = tally(outs, prompt_len)
        if phases:
            ran = Exercised(ran.ok, ran.total, ran.dropped, ran.error,
                            soak_answered(phases, outs), res.reset_status)
        outcome = hooks.outcome(n, s, log_path, ran, failure, None,
                                (0.0, 0.0, 0.0, time.monotonic() - t0))
        return replace(outcome, device_peaks_mib=dict(res.peaks_mib), device_reader="emulated",
                       device_total_mib=res.total_mib, device_last_mib=dict(res.last_mib),
                       speed=emulated_speed(res, s, prompt_len))

    return setup.cfg, execute
