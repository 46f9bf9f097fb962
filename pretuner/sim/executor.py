"""Launches on the emulated card without processes: the same server code, run in this process.

`inprocess_executor` is an `Executor` for `Tuner`: it builds each launch's command exactly as
a real run does, runs the emulated server in-process (`pretuner.sim.inproc`), writes its log
to the launch folder, scans it with the real scanner and classifies it with the real
classifier. Benchmarks and decision tests use it; `pretuner run` never does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pretuner.engines.base import Family, LaunchCommand, LaunchSettings
from pretuner.engines.mindspore_r01 import SIM, outcome_of
from pretuner.engines.outcome import LaunchOutcome, tally, workload
from pretuner.engines.registry import EngineChoice
from pretuner.errors import ServerFailedError
from pretuner.launch.collect import rank_peaks
from pretuner.launch.probe import CompletionOutcome
from pretuner.launch.process import read_tail
from pretuner.logscan import scan_paths
from pretuner.logscan.lines import DeviceMemoryInit, parse_line
from pretuner.sim import inproc
from pretuner.sim.plugin import EMULATOR
from pretuner.tune.entry import RunOptions
from pretuner.tune.execute import Phase
from pretuner.tune.r01.config import CardInfo, TuneResult
from pretuner.tune.r01.loop import Tuner
from pretuner.tune.r01.setup import r01_setup

DECODE_TOKENS = 16


def inprocess_executor(
    build: Callable[[LaunchSettings, int], LaunchCommand],
    workdir: Path,
    decode_tokens: int = DECODE_TOKENS,
) -> Callable[[LaunchSettings], LaunchOutcome]:
    """An executor that runs every launch on the in-process emulated server."""
    counter = itertools.count(1)

    def execute(settings: LaunchSettings) -> LaunchOutcome:
        n = next(counter)
        t0 = time.monotonic()
        cmd = build(settings, 0)
        argv = EMULATOR.server_flags("r01", cmd.argv)
        count, plen, gen = workload(settings, decode_tokens)
        res = inproc.run(argv, cmd.env, [plen] * count, gen)
        folder = workdir / f"launch-{n}"
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "server.log"
        log_path.write_text(res.log, encoding="utf-8")
        scan = scan_paths([log_path])
        outs = [
            CompletionOutcome(r.status, r.status == 200, 0.0, r.prompt_tokens,
                              r.completion_tokens, r.error)
            for r in res.replies
        ]
        failure = None
        if not res.ready and not scan.oom:
            failure = ServerFailedError(
                f"the server exited with code {res.exit_code} before it was ready",
                hint=f"log {log_path}\nlast log lines:\n{read_tail(log_path, 15)}",
                log_path=str(log_path),
            )
        outcome = outcome_of(
            n,
            settings,
            scan,
            tally(outs, plen) if res.ready else tally([], plen),
            failure=failure,
            graceful=res.exit_code == 0,
            init_free_mib=_init_free_mib(res.log),
            log_path=log_path,
            problem=None,
            worst_node=None,
            rank_peaks_mib=rank_peaks(scan),
            times=(0.0, 0.0, 0.0, time.monotonic() - t0),
        )
        if not res.device_peak_mib:
            return outcome
        # What the sampler of a real run reads from the emulated npu-smi.
        return replace(outcome, device_peaks_mib={"run": res.device_peak_mib},
                       device_reader="emulated npu-smi (in process)",
                       device_total_mib=res.device_total_mib)

    return execute


def _init_free_mib(log: str) -> list[int]:
    """`Device free MOC Size` of every MindSpore init line (what the live follower reads)."""
    found = []
    for line in log.splitlines():
        if "Device MOC Size" in line or "Device HBM Size" in line:
            event = parse_line(line)
            if isinstance(event, DeviceMemoryInit) and event.device_free_mib:
                found.append(event.device_free_mib)
    return found


def tune_in_process(
    opts: RunOptions, workdir: Path, card: CardInfo | None = None, phase: Phase | None = None
) -> TuneResult:
    """The whole loop against the emulated server run in this process (benchmarks, tests)."""
    choice = EngineChoice(SIM, Family.R01, True, None, "in-process emulated card")
    setup = r01_setup(opts, choice, card)
    execute = inprocess_executor(setup.ctx.build, workdir, setup.ctx.decode_tokens)
    return Tuner(setup.cfg, execute, phase or (lambda p, d: None)).run()
