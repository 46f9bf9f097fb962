"""V1 launches on the emulated card without processes (benchmarks, fast tests).

Same command line, boot, memory accounting and log lines as `pretuner sim vllm serve`, run
in this process (`pretuner.sim.v1.inproc`); its log is judged by the same `V1Hooks.outcome`
as a real launch's, and the per-phase device peaks are what the emulated NVML would have
shown a sampler. One difference from a subprocess launch: the validation's concurrency is
computed from the pinned bytes before the boot (a real launch reads the log's token count),
which can differ by a request where the block rounding straddles a multiple of max_model_len.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pretuner.engines.base import Family, LaunchCommand, LaunchSettings, Purpose
from pretuner.engines.outcome import Exercised, LaunchOutcome, tally
from pretuner.engines.registry import EngineChoice
from pretuner.engines.v1_images import SOAK_PHASES, Soak
from pretuner.engines.v1_launch import V1Hooks, concurrency, unexplained_exit
from pretuner.launch import probe
from pretuner.launch.images import ImageShape, LoadPhase, validation_phases, worst_case
from pretuner.launch.probe import CompletionOutcome
from pretuner.sim.plugin import EMULATOR
from pretuner.speed import Speed
from pretuner.tune.execute import Phase
from pretuner.tune.options import RunOptions
from pretuner.tune.pinned.loop import V1Result, V1Tuner
from pretuner.tune.pinned.setup import pinned_setup

if TYPE_CHECKING:
    from pretuner.sim.v1.inproc import V1InprocRun

DECODE_TOKENS = 16


def inprocess_v1_executor(
    build: Callable[[LaunchSettings, int], LaunchCommand],
    workdir: Path,
    bytes_per_token: int,
    decode_tokens: int = DECODE_TOKENS,
    *,
    images: ImageShape | None = None,
    soak: Soak | None = None,
    seed: int = 0,
) -> Callable[[LaunchSettings], LaunchOutcome]:
    """An executor that runs every launch on the in-process emulated V1 server; a
    vision-language model's launches get `pretuner.engines.v1_images`' requests, with the
    emulator's own chat template (what the HTTP path calibrates)."""
    from pretuner.sim.v1 import inproc
    from pretuner.sim.v1.chat import TEMPLATE_TOKENS

    counter = itertools.count(1)
    soak = soak or Soak()
    hooks = V1Hooks(bytes_per_token, images, soak)
    shape = images if images is not None and not images.is_text_only else None

    def image_phases(images: ImageShape, s: LaunchSettings) -> list[LoadPhase]:
        if s.purpose is Purpose.PRERUN:
            req = worst_case(images, s.max_model_len, 1, f"probe/{seed}", TEMPLATE_TOKENS)
            return [LoadPhase("probe", (req,))]
        decode = min(decode_tokens, max(1, s.max_model_len // 2))
        return validation_phases(images, s.max_model_len, decode,
                                 concurrency(s, None, bytes_per_token), soak.planned, seed,
                                 TEMPLATE_TOKENS)

    def execute(s: LaunchSettings) -> LaunchOutcome:
        n = next(counter)
        t0 = time.monotonic()
        cmd = build(s, 0)
        argv = EMULATOR.server_flags("v1", cmd.argv)
        if argv[:1] == ["serve"]:
            argv = argv[1:]
        plen: int | None
        phases: list[LoadPhase] = []
        if shape is not None:
            phases = image_phases(shape, s)
            res = inproc.run_waves(argv, cmd.env, inproc.waves_of(phases))
            plen = None
        elif s.purpose is Purpose.PRERUN:
            plen = probe.max_length_prompt_len(s.max_model_len, 1)
            res = inproc.run(argv, cmd.env, [plen], 1)
        else:
            decode = min(decode_tokens, max(1, s.max_model_len // 2))
            plen = probe.max_length_prompt_len(s.max_model_len, decode)
            count = concurrency(s, None, bytes_per_token)
            res = inproc.run(argv, cmd.env, [plen] * count, decode, first=plen)
        folder = workdir / f"launch-{n}"
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "server.log"
        log_path.write_text(res.log, encoding="utf-8")
        outs = [CompletionOutcome(r.status, r.status == 200, 0.0, r.prompt_tokens,
                                  r.completion_tokens, r.error) for r in res.replies]
        failure = None if res.ready or "out of memory" in res.log.lower() \
            or "estimated maximum model length" in res.log \
            or "cache blocks" in res.log else unexplained_exit(log_path, res.exit_code)
        ran = tally(outs, plen)
        if phases:
            ran = Exercised(ran.ok, ran.total, ran.dropped, ran.error,
                            soak_answered(phases, outs), res.reset_status)
        outcome = hooks.outcome(n, s, log_path, ran, failure, None,
                                (0.0, 0.0, 0.0, time.monotonic() - t0))
        return replace(outcome, device_peaks_mib=dict(res.peaks_mib), device_reader="emulated",
                       device_total_mib=res.total_mib, device_last_mib=dict(res.last_mib),
                       speed=emulated_speed(res, s, plen))

    return execute


def soak_answered(phases: list[LoadPhase], outs: list[CompletionOutcome]) -> int:
    """How many of the soak's requests were answered 200 (replies come in phase order)."""
    answered, i = 0, 0
    for p in phases:
        got = outs[i:i + len(p.requests)]
        i += len(p.requests)
        if p.name in SOAK_PHASES:
            answered += sum(o.ok for o in got)
    return answered
def emulated_speed(res: V1InprocRun, s: LaunchSettings, prompt_len: int | None) -> Speed | None:
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
    tests): the same setup, loop and judge as `pretuner run --engine vllm`."""
    choice = EngineChoice(opts.engine, Family.V1, True, None, "in-process emulated V1 server")
    setup = pinned_setup(opts, choice)
    execute = inprocess_v1_executor(setup.ctx.build, workdir, setup.cfg.bytes_per_token,
                                    images=setup.vision.images, soak=setup.vision.soak,
                                    seed=opts.seed)
    return V1Tuner(setup.cfg, execute, phase or (lambda p, d: None)).run()
