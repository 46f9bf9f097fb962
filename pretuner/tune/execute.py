"""One launch, start to finish: start the server, probe or load it, stop it gracefully, scan
its log, and say what happened in one classified outcome; `recorded_executor` journals each
launch and replays the finished ones on --resume."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pretuner.devices import DeviceReader
from pretuner.devices.base import attach
from pretuner.engines.base import API_KEY_VAR, LaunchCommand, LaunchSettings, Purpose
from pretuner.engines.base import Phase as Phase
from pretuner.engines.mindspore_r01 import outcome_of
from pretuner.engines.outcome import (
    BURST_OUTPUT_TOKENS,
    Executor,
    Exercised,
    LaunchOutcome,
    probe_one,
    short_burst,
    tally,
    workload,
)
from pretuner.engines.v1_images import SOAK_PHASES
from pretuner.engines.v1_launch import V1Hooks
from pretuner.errors import CardBusyError, PretunerError, ServerFailedError
from pretuner.files import write_atomic
from pretuner.launch import probe
from pretuner.launch.collect import CollectorFactory, LocalCollector
from pretuner.launch.process import ServerProcess
from pretuner.launch.sampler import Sampled, requests_status, series_tsv
from pretuner.logscan.events import DeviceMemoryInit, Located, OomEvent, OomKind
from pretuner.procgroups import group_members, proc_available
from pretuner.redact import redact_text
from pretuner.tune.busy import Tenants, device_busy
from pretuner.tune.record import RunRecord

log = logging.getLogger(__name__)

CRASH_SETTLE_S = 1.0  # how long a server whose requests failed may take to finish dying
# A V1 launch that already failed (an OOM in its log, a server that died) has nothing left to
# write: real vLLM's API server, its EngineCore dead of an OOM at start-up, ignored SIGTERM
# for the whole --stop-grace (120 s a launch). It gets this long, then SIGKILL.
FAILED_V1_STOP_GRACE_S = 10.0



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
    burst_tokens: int = BURST_OUTPUT_TOKENS  # what each request of the short burst generates
    seed: int = 0
    vocab_size: int | None = None  # the model's: probe prompts' token ids stay within it
    collector: CollectorFactory | None = None  # where logs are read; default: this machine
    device_reader: DeviceReader | None = None  # samples the card during launches; None: logs only
    # V1 engines exercise and judge their launches their own way (no pool dump: the device
    # peak is the measurement). None: the r0.1 engine's pool-dump rules below.
    hooks: V1Hooks | None = None
    # False: a --serve-cmd wrapper (a container, srun) may start the server outside pretuner's
    # process group, where its processes cannot be told from another tenant's during a launch.
    server_in_group: bool = True


class _OomSeen(Exception):
    """Raised from the readiness/request wait when the live log shows an OOM."""



# The server's port is chosen here and bound by the server seconds later (after a Ray
# placement, a container's start). A port from the kernel's ephemeral range can be taken
# meanwhile by any outgoing connection (Ray opens many), so it comes from below that range,
# above Ray's worker ports (10002-19999 by default): only another explicit choice can meet it.
PORTS_FROM = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default low end, where the file cannot be read


def free_port(host: str, rng: random.Random | None = None) -> int:
    """A port nothing listens on, outside the ephemeral range when there is room below it
    (else one the kernel picks)."""
    rng = rng or random.SystemRandom()
    low = _ephemeral_low()
    candidates = [rng.randrange(PORTS_FROM, low) for _ in range(32)] if low > PORTS_FROM else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on {host}")


def run_launch(
    n: int, settings: LaunchSettings, ctx: LaunchContext, record: RunRecord, phase: Phase,
    tenants: Tenants | None = None,
) -> LaunchOutcome:
    """Start, exercise, stop and scan one server; fatal surprises raise ServerFailedError, a
    process that came on the device during the load CardBusyError (`tenants`)."""
    t0 = time.monotonic()
    folder = record.launch_dir(n)
    port = free_port(ctx.host)
    log_path = folder / "server.log"
    collector = (ctx.collector or LocalCollector)(folder, log_path)
    cmd = collector.prepare(ctx.build(settings, port))
    shown = cmd.redacted()  # the secrets of --serve-cmd and the environment never stored
    (folder / "command.json").write_text(redact_text(
        json.dumps({"argv": shown.argv, "env": shown.env, "shell": shown.shell_line()}, indent=2)
        + "\n"), encoding="utf-8")
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
    ran = Exercised(0, 0, 0, None)
    failure: ServerFailedError | None = None
    exited: int | None = None
    sampler = collector.sampler(ctx.device_reader, phase)
    phase = sampler.wrap(phase)
    phase("launch", f"{settings.purpose.value} {_describe(settings)}")
    launch_env = {**os.environ, **cmd.env}
    proc = ServerProcess.start(cmd.argv, launch_env, log_path)
    attach(ctx.device_reader, proc.pid)  # a reader of the server's own processes follows it
    try:
        sampler.start()  # on a cluster: returns once every node's sampler is running
        try:
            phase("loading", f"waiting for {base}/health")
            w0 = time.monotonic()
            proc.wait_ready(f"{base}/health", ctx.ready_timeout_s, check=check)
            ready_s = time.monotonic() - w0
            phase("ready", f"after {ready_s:.1f} s")
            r0 = time.monotonic()
            with probe.bearer(base, cmd.bearer or launch_env.get(API_KEY_VAR)):
                ran = (ctx.hooks.exercise(settings, ctx, base, phase, log_path) if ctx.hooks
                       else _exercise(settings, ctx, base, phase))
            request_s = time.monotonic() - r0
            if tenants is not None and _sees_own_tree(ctx):
                members = set(group_members(proc.pid))
                tenants.check(f"during launch {n}'s load", ours=lambda pid: pid in members
                              or not Path(f"/proc/{pid}").exists())
            with contextlib.suppress(_OomSeen):
                check()
        except _OomSeen:
            pass
        except ServerFailedError as err:
            failure = err
        # A server that dropped a request, or whose log just said out of memory, is often
        # still dying: a moment lets a crash be named one (its own exit code) instead of a
        # server pretuner stopped.
        exited = proc.poll_settled(CRASH_SETTLE_S if ran.ok < ran.total or seen else 0.0)
        grace = stop_grace(ctx, failed=bool(seen) or failure is not None)
        phase("stop", f"SIGTERM to the process group, waiting up to {grace:g} s for it to exit"
              + ("" if ctx.hooks else " (and write its memory-pool dump)"))
        s0 = time.monotonic()
        stop = proc.stop(grace)
        stop_s = time.monotonic() - s0
    finally:
        try:
            proc.stop(ctx.stop_grace_s)  # idempotent; runs on Ctrl-C too
        finally:
            sampled = sampler.stop()
    if (series := series_tsv(sampled, n)) is not None:  # the report's memory-over-time chart
        try:
            write_atomic(folder / "memory.tsv", series)
        except (OSError, PretunerError) as err:  # a chart lost is no reason to lose the launch
            log.warning("cannot write %s: %s", folder / "memory.tsv", err)
    consume(collector.poll(final=True))
    if failure is not None and not seen and (refusal := device_busy(log_path)) is not None:
        raise refusal
    if ctx.hooks is not None:
        times = (ready_s, request_s, stop_s, time.monotonic() - t0)
        outcome = ctx.hooks.outcome(n, settings, log_path, ran, failure, exited, times)
        return with_samples(outcome, sampled)
    phase("scan", collector.where())
    collected = collector.collect()
    (folder / "scan.json").write_text(redact_text(json.dumps(collected.doc, indent=2)) + "\n",
                                      "utf-8")
    outcome = outcome_of(
        n, settings, collected.scan, ran, failure=failure, graceful=stop.graceful,
        init_free_mib=[*free, *collected.init_free_mib], log_path=log_path,
        problem=collected.problem, worst_node=collected.worst_node,
        rank_peaks_mib=collected.rank_peaks_mib,
        times=(ready_s, request_s, stop_s, time.monotonic() - t0), exited=exited,
    )
    return with_samples(outcome, sampled)


def stop_grace(ctx: LaunchContext, *, failed: bool) -> float:
    """Seconds between SIGTERM and SIGKILL: --stop-grace, at most FAILED_V1_STOP_GRACE_S for
    a V1 launch that failed (r0.1 writes its memory-pool dump at any stop: it keeps them all)."""
    if failed and ctx.hooks is not None:
        return min(ctx.stop_grace_s, FAILED_V1_STOP_GRACE_S)
    return ctx.stop_grace_s


def _sees_own_tree(ctx: LaunchContext) -> bool:
    """Whether the device's process list can be told apart from the launch's own server while
    it runs: its processes are its process group (a pid this machine's /proc does not show,
    as in a container, may be it). A wrapper's engine, a Ray cluster's ranks and the emulated
    r0.1 server's ranks (pids it makes up) are outside that: there the device is looked at
    between launches only."""
    return (ctx.hooks is not None and ctx.server_in_group and ctx.collector is None
            and proc_available())


def with_samples(outcome: LaunchOutcome, sampled: Sampled) -> LaunchOutcome:
    """The outcome with what the device sampler saw."""
    soak = tuple((p.t_s, max(mib for _, mib in p.used_mib)) for p in sampled.series
                 if p.phase in SOAK_PHASES and p.used_mib)
    worst_node = max(sampled.node_peaks_mib, key=lambda n: sampled.node_peaks_mib[n],
                     default=outcome.worst_node)
    return replace(outcome, device_peaks_mib=sampled.peaks_mib, device_reader=sampled.reader,
                   device_total_mib=sampled.total_mib, device_last_mib=sampled.last_mib,
                   soak_series=soak, node_peaks_mib=sampled.node_peaks_mib,
                   worst_node=outcome.worst_node or worst_node,
                   notes=outcome.notes + ((sampled.failure,) if sampled.failure else ()))


def _describe(s: LaunchSettings) -> str:
    if s.kv_cache_bytes is not None:  # a V1 engine, KV pinned
        kv = f"--kv-cache-memory-bytes {s.kv_cache_bytes} ({s.kv_cache_bytes / 2**30:.2f} GiB)"
    elif s.model_use_gib == 0:  # a V1 engine profiling at util
        kv = f"util {s.util:g} (the engine profiles)"
    else:
        kv = f"util {s.util:g}, model-use {s.model_use_gib} GiB"
    return f"{kv}, max_model_len {s.max_model_len:,}, max-num-seqs {s.max_num_seqs}"


def _exercise(s: LaunchSettings, ctx: LaunchContext, base: str, phase: Phase) -> Exercised:
    """The pre-run's one max-length request, or the validation: max-num-seqs concurrent
    max-length requests (the KV cache is sized to hold them), then the wide short burst."""
    if s.purpose is Purpose.PRERUN:
        return probe_one(s, ctx, base, phase)
    count, plen, gen = workload(s, ctx.decode_tokens)
    phase("load", f"{count} concurrent requests of {plen + gen:,} tokens")
    ran = tally(probe.load(base, ctx.served_name, count, plen, gen, ctx.seed,
                           ctx.request_timeout_s, ctx.vocab_size,
                           on_done=requests_status(phase)).outcomes, plen)
    return ran if ran.ok < ran.total else short_burst(s, ctx, base, phase, None, ran)


def recorded_executor(record: RunRecord, ctx: LaunchContext, phase: Phase) -> Executor:
    """Run launches for real, journaling each; on --resume, replay the finished ones."""
    done = [LaunchOutcome.from_json(e["outcome"]) for e in record.of_kind("launch")]
    counter = itertools.count(1)
    tenants = Tenants(ctx.device_reader)

    def execute(settings: LaunchSettings) -> LaunchOutcome:
        n = next(counter)
        if n <= len(done) and done[n - 1].settings == settings:
            phase("replay", f"launch {n} finished in the earlier session: {done[n - 1].kind.value}")
            return done[n - 1]
        tenants.check(f"before launch {n}")
        record.append("launch_started", n=n, settings=settings.to_json())
        try:
            outcome = run_launch(n, settings, ctx, record, phase, tenants)
        except CardBusyError:
            raise
        except PretunerError:
            tenants.check(f"after launch {n}")  # a failure beside another process: its doing
            raise
        tenants.check(f"after launch {n}")
        record.append("launch", n=n, outcome=outcome.to_json())
        return outcome

    return execute
