"""`python -m pretuner.sim vllm serve MODEL ...`: the emulated vLLM 0.24 server process.

Opens its socket once booted, serves until SIGTERM/SIGINT (exit 0), keeps serving 500s with a
dead engine after an OOM, exits 1 on a failed start. It publishes its memory per GPU and holds
every level (`boot.Sink`), so a 20 ms sampler in another process sees each transient."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from pretuner.sim.argv import serve_main
from pretuner.sim.http import ANY_HOST, print_routes, serve_in_thread, uvicorn_started
from pretuner.sim.state import boot_noise_mib, others_bytes, state_dir
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.boot import Booted, Sink, Stopped, boot, devices_for
from pretuner.sim.v1.config import V1Config, build_parser, parse
from pretuner.sim.v1.engine import Engine, EngineCore
from pretuner.sim.v1.http import ApiConfig, V1HTTPServer
from pretuner.stopflag import StopFlag

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /reset_mm_cache and other dev routes
CORE_PID_OFFSET = 69  # the real EngineCore is a child process: a made-up pid beside ours
ROUTES = (("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/health", "GET"),
          ("/metrics", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
          ("/v1/models", "GET"), ("/version", "GET"), ("/v1/chat/completions", "POST"),
          ("/v1/completions", "POST"))
DEV_ROUTES = (("/reset_mm_cache", "POST"), ("/reset_prefix_cache", "POST"))


def serve(cfg: V1Config) -> int:
    """Boot, then serve until SIGTERM/SIGINT; the exit code."""
    stop, state = StopFlag(), state_dir(cfg.env)
    cfg = replace(cfg, boot_noise_mib=boot_noise_mib(state, cfg.boot_noise_mib))
    stop.install()
    devices = devices_for(cfg) or []  # too few: boot refuses
    sink = Sink(L.V1Log(os.getpid(), os.getpid() + CORE_PID_OFFSET), 0, stop=stop, state=state,
                devices=tuple(devices))
    try:
        booted = boot(cfg, sink, others_bytes=others_bytes(state, "cuda",
                                                            [(0, d) for d in devices]))
        return 1 if booted is None else _serve(cfg, booted, sink, stop)
    except Stopped:
        return 0
    finally:
        sink.files.remove()


def _serve(cfg: V1Config, booted: Booted, sink: Sink, stop: StopFlag) -> int:
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
