"""`python -m pretuner.sim vllm serve MODEL ...`: the emulated vLLM 0.24 server process.

Opens its socket once booted, serves until SIGTERM/SIGINT (exit 0), keeps serving 500s with a
dead engine after an OOM, exits 1 on a failed start. It publishes its memory per GPU and holds
every level for `HOLD_S`, so a 20 ms sampler in another process sees each transient."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pretuner.sim.argv import serve_main
from pretuner.sim.http import ANY_HOST, print_routes, serve_in_thread, uvicorn_started
from pretuner.sim.state import Published, others_bytes, state_dir
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.boot import Booted, boot
from pretuner.sim.v1.config import V1Config, build_parser, parse
from pretuner.sim.v1.engine import Engine, EngineCore
from pretuner.sim.v1.http import ApiConfig, V1HTTPServer
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.stopflag import StopFlag
from pretuner.units import MIB

HOLD_S = 0.1  # every published level lasts at least this long
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /reset_mm_cache and other dev routes
CORE_PID_OFFSET = 69  # the real EngineCore is a child process: a made-up pid beside ours
ROUTES = (("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/health", "GET"),
          ("/metrics", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
          ("/v1/models", "GET"), ("/version", "GET"), ("/v1/chat/completions", "POST"),
          ("/v1/completions", "POST"))
DEV_ROUTES = (("/reset_mm_cache", "POST"), ("/reset_prefix_cache", "POST"))


class Stopped(Exception):
    """A stop signal came during start-up."""


def devices_for(cfg: V1Config) -> list[int] | None:
    """The GPUs the ranks use (one each, in CUDA_VISIBLE_DEVICES order); None if too few."""
    visible = list(cfg.visible) if cfg.visible is not None else list(
        range(CUDA_PROFILES[cfg.profile].gpus_per_node))
    return visible[:cfg.tp] if len(visible) >= cfg.tp else None


class _Publisher:
    """The boot Sink of the subprocess server: publishes, holds, sleeps, honours a stop."""

    def __init__(self, log: L.V1Log, state: Path, devices: list[int],
                 stop: StopFlag) -> None:
        self.log = log
        self.state = state
        self.devices = devices
        self.stop = stop
        self.files = Published()

    def level(self, process_bytes: int) -> None:
        for device in self.devices:
            self.files.hold(self.state, "cuda", 0, device, -(-process_bytes // MIB))
        time.sleep(HOLD_S)

    def pause(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Stopped

    def unpublish(self) -> None:
        self.files.remove()


class Server:
    def __init__(self, cfg: V1Config) -> None:
        self.cfg = cfg
        self.stop = StopFlag()
        self.log = L.V1Log(os.getpid(), os.getpid() + CORE_PID_OFFSET)
        self.state = state_dir(cfg.env)

    def run(self) -> int:
        self.stop.install()
        devices = devices_for(self.cfg)
        if devices is None:
            self.log.raw(L.API, ["Traceback (most recent call last):", "ValueError: The number "
                                 "of required GPUs exceeds the total number of available GPUs "
                                 "in the placement group."])
            return 1
        sink = _Publisher(self.log, self.state, devices, self.stop)
        try:
            booted = boot(self.cfg, sink,
                          others_bytes=others_bytes(self.state, "cuda",
                                                    [(0, d) for d in devices]))
        except Stopped:
            sink.unpublish()
            return 0
        if booted is None:
            sink.unpublish()
            return 1
        core = EngineCore(booted, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
        scale = self.cfg.time_scale  # PRETUNER_SIM_TIME_SCALE
        engine = Engine(core, self.log, sink.level,
                        lambda tokens: booted.clock.step_seconds(tokens) * scale)
        try:
            http = self._open(engine, booted)
        except OSError as err:
            self.log.api("launcher.py:60", f"[Errno {err.errno}] error while attempting to bind "
                         f"on address: {err.strerror}", level="ERROR")
            sink.unpublish()
            return 1
        engine.start()
        serve_in_thread(http, 0.05)
        self.stop.wait()
        self._shutdown(http, engine)
        sink.unpublish()
        return 0

    def _open(self, engine: Engine, booted: Booted) -> V1HTTPServer:
        cfg, log = self.cfg, self.log
        host = cfg.host or ANY_HOST
        api = ApiConfig(cfg.served_names, cfg.model, booted.max_model_len, booted.vision,
                        dev_mode=cfg.env.get(DEV_MODE_ENV) == "1")
        http = V1HTTPServer((host, cfg.port), engine, api, log)
        print_ready(log, host, http.server_address[1], dev=api.dev_mode)
        return http

    def _shutdown(self, http: V1HTTPServer, engine: Engine) -> None:
        print_shutdown(self.log, self.stop.signal_name or "SIGTERM")
        engine.stop()
        http.shutdown()
        http.server_close()
        print_stopped(self.log)


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
    return serve_main(args[1:], "vllm serve", build_parser, parse,
                      lambda cfg: Server(cfg).run())
