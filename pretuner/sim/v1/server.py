"""`python -m pretuner.sim vllm serve MODEL ...`: the emulated vLLM 0.24 server process.

Opens its socket once booted, serves until SIGTERM/SIGINT (exit 0), keeps serving 500s with a
dead engine after an OOM, exits 1 on a failed start. It publishes its memory per GPU and holds
every level (`boot.Sink`), so a 20 ms sampler in another process sees each transient."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pretuner.errors import PretunerError
from pretuner.sim.argv import serve_main
from pretuner.sim.http import ANY_HOST, print_routes, serve_in_thread, uvicorn_started
from pretuner.sim.state import (
    STATE_DIR_ENV,
    boot_noise_mib,
    compile_entry,
    others_bytes,
    state_dir,
)
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.boot import Booted, Sink, Stopped, boot, devices_for
from pretuner.sim.v1.config import V1Config, build_parser, parse
from pretuner.sim.v1.engine import Engine, EngineCore
from pretuner.sim.v1.http import ApiConfig, V1HTTPServer
from pretuner.stopflag import StopFlag

if TYPE_CHECKING:
    from pretuner.sim.raynodes import RayRanks

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /reset_mm_cache and other dev routes
PUBLISH_TIMEOUT_S = 30.0  # the longest a node's card may take to show a new level
CORE_PID_OFFSET = 69  # the real EngineCore is a child process: a made-up pid beside ours
ROUTES = (("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/health", "GET"),
          ("/metrics", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
          ("/v1/models", "GET"), ("/version", "GET"), ("/v1/chat/completions", "POST"),
          ("/v1/completions", "POST"))
DEV_ROUTES = (("/reset_mm_cache", "POST"), ("/reset_prefix_cache", "POST"))


def serve(cfg: V1Config) -> int:
    """Boot, then serve until SIGTERM/SIGINT; the exit code."""
    stop, state = StopFlag(), state_dir(cfg.env)
    cfg = replace(cfg, boot_noise_mib=boot_noise_mib(state, cfg.boot_noise_mib),
                  compiled_before=compile_entry(state, cfg.compile_key).exists())
    stop.install()
    devices = devices_for(cfg) or []  # too few: boot refuses
    sink = Sink(L.V1Log(os.getpid(), os.getpid() + CORE_PID_OFFSET), 0, stop=stop, state=state,
                devices=tuple(devices))
    lost = threading.Event()
    remote = None
    try:
        if cfg.backend == "ray":
            remote = _place_on_ray(cfg, sink, stop, lost)
            if remote is None:
                return 1
        booted = boot(cfg, sink, others_bytes=others_bytes(state, "cuda",
                                                            [(0, d) for d in devices]))
        if booted is None:
            return 1
        code = _serve(cfg, booted, sink, stop, lost)
        return 1 if lost.is_set() else code
    except Stopped:
        return 1 if lost.is_set() else 0
    finally:
        sink.files.remove()
        if remote is not None:
            remote.close()


def _place_on_ray(cfg: V1Config, sink: Sink, stop: StopFlag,
                  lost: threading.Event) -> RayRanks | None:
    """vLLM's Ray executor: one GPU per rank on RAY_ADDRESS's cluster, this node first; each
    node's GPUs hold what the worst rank holds. None when the ranks cannot be placed (printed)."""
    log, world = sink.log, cfg.tp * cfg.pp
    try:
        from pretuner.sim.raynodes import GpuAgent, PlacementFailed, RayRanks

        remote = RayRanks(cfg.env.get("RAY_ADDRESS") or "auto", list(range(world)), "GPU",
                          GpuAgent, (cfg.env.get(STATE_DIR_ENV),))
    except (ImportError, PlacementFailed, PretunerError) as err:
        text = err.message if isinstance(err, PretunerError) else str(err)
        log.raw(L.CORE, ["Traceback (most recent call last):", f"ValueError: {text}"])
        log.raw(L.API, L.api_failure_lines())
        return None
    stop.install()  # Ray's core installs its own SIGTERM handler: vLLM's come after it
    for agent, (node, first, count) in zip(remote.agents, remote.placement.spans(), strict=True):
        pid, ip, gpus = remote._ray.get(agent.whoami.remote())
        for rank, gpu in zip(range(first, first + count), gpus, strict=False):
            log.worker(pid, None if node.local else ip, "parallel_state.py:1165",
                       f"rank {rank} in world size {world} is assigned as DP rank 0, PP rank "
                       f"{rank // cfg.tp}, TP rank {rank % cfg.tp}, EP rank {rank % cfg.tp} "
                       f"(GPU {gpu})")
    log.core("ray_executor.py:212", "Ray ranks: " + remote.placement.describe())
    def publish(mib: int) -> None:
        # Held on every node before the server goes on, as an allocation is: a level sent
        # and not waited for reached a busy node's card after its sampler had stopped.
        with contextlib.suppress(Exception):  # a node gone: its watch says so (on_lost)
            remote._ray.get([agent.level.remote(mib) for agent in remote.agents],
                            timeout=PUBLISH_TIMEOUT_S)

    def on_lost(why: str) -> None:
        log.block(L.CORE, "ERROR", L.WHERE_FATAL, ["EngineCore encountered a fatal error.",
                                                   f"RuntimeError: {why}"])
        log.raw(L.API, [f"vllm.v1.engine.exceptions.EngineDeadError: {L.ENGINE_DEAD}"])
        lost.set()
        stop.set()

    sink.publish = publish
    remote.watch(on_lost)
    return remote


def _serve(cfg: V1Config, booted: Booted, sink: Sink, stop: StopFlag,
           lost: threading.Event | None = None) -> int:
    log = sink.log
    engine = Engine(EngineCore(booted, log), sink.level, cfg.time_scale)
    host = cfg.host or ANY_HOST
    api = ApiConfig(cfg.served_names, cfg.model, booted.max_model_len, cfg.api_keys,
                    booted.vision, dev_mode=cfg.env.get(DEV_MODE_ENV) == "1")
    try:
        http = V1HTTPServer((host, cfg.port), engine, api, log)
    except OSError as err:
        log.api("launcher.py:60", f"[Errno {err.errno}] error while attempting to bind on "
                f"address: {err.strerror}", level="ERROR")
        return 1
    print_ready(log, host, http.server_address[1], dev=api.dev_mode)
    engine.start()
    serve_in_thread(http, 0.05)
    stop.wait()
    if lost is not None and lost.is_set():  # a Ray worker died: the engine is gone
        return 1
    print_shutdown(log, stop.signal_name or "SIGTERM")
    http.close_gracefully()  # the requests in progress end first, the engine running
    engine.stop()
    http.server_close()
    print_stopped(log)
    return 0


def print_ready(log: L.V1Log, host: str, port: int, dev: bool = False) -> None:
    """What the APIServer prints once the engine is up and the socket is open."""
    log.api("api_server.py:577", "Supported tasks: ['generate']")
    log.api("api_server.py:581", f"Starting vLLM server on http://{host}:{port}")
    print_routes(log.api, ("launcher.py:37", "launcher.py:46"),
                 ROUTES + (DEV_ROUTES if dev else ()))
    uvicorn_started(log, log.api_pid)


def print_stopped(log: L.V1Log) -> None:
    for line in ("Shutting down", "Waiting for application shutdown.",
                 "Application shutdown complete."):
        log.uvicorn(line)


def print_shutdown(log: L.V1Log, signal_name: str) -> None:
    """The [shutdown] lines of a graceful stop."""
    log.core("core.py:1214", f"[shutdown] EngineCore: trigger received signal={signal_name}")
    log.api("launcher.py:100", "[shutdown] API server: shutdown triggered")
    log.core("core.py:1227", "[shutdown] EngineCore: exiting busy loop")
    log.api("core_client.py:662", "[shutdown] MPClient: complete")
    log.api("launcher.py:149", "[shutdown] API server: shutting down FastAPI HTTP server")


USAGE = "usage: python -m pretuner.sim vllm serve MODEL [vllm serve options]\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`vllm serve ...` (argv starts with `serve`); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "serve":
        sys.stderr.write(USAGE)
        return 2
    return serve_main(args[1:], "vllm serve", build_parser, parse, serve)
