"""The emulated servers' shared command line: vLLM's spelling rule, the flags every vLLM
server takes, the emulator's knobs from the environment, and the `main` both servers run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

C = TypeVar("C")


class UsageError(Exception):
    """A command line or emulator setting the server refuses before it starts."""


class Refused(Exception):
    """The server dies starting, with the Python exception `exc_type: message`; `where` is the
    traceback frame it prints (r0.1) or the start-up stage that failed (V1)."""

    def __init__(self, exc_type: str, message: str, where: str = "") -> None:
        super().__init__(message)
        self.exc_type, self.message, self.where = exc_type, message, where


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser: `--max_model_len` is `--max-model-len`."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def server_parser(prog: str, description: str, epilog: str, *,
                  length: Callable[[str], int] = int,
                  model_help: str | None = None) -> argparse.ArgumentParser:
    """A parser with the flags both emulated vLLM servers read the same way; `length` parses
    --max-model-len and --max-num-batched-tokens."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    p.add_argument("model_tag", nargs="?", default=None, help=model_help)
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", nargs="+", default=None)
    p.add_argument("--max-model-len", type=length, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=length, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    return p


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerArgs:
    """What both emulated servers read alike from their command line and environment."""

    model: str
    host: str | None
    port: int
    served_names: tuple[str, ...]
    max_model_len: int | None
    max_num_seqs: int
    util: float
    block_size: int
    tp: int
    profile: str
    startup_s: float
    occupied_mib: int = 0  # another tenant's share of every card
    boot_noise_mib: int = 0  # PRETUNER_SIM_BOOT_NOISE_MIB: every other boot holds this much more
    env: dict[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # --api-key, else VLLM_API_KEY: /v1 routes want one


def parse_known(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str],
                no_model: str) -> tuple[argparse.Namespace, dict[str, Any]]:
    """(namespace, `ServerArgs` fields of the command line); UsageError(`no_model`) without a
    model."""
    ns, unknown = parser.parse_known_args(list(argv))
    model = ns.model or ns.model_tag
    if not model:
        raise UsageError(no_model)
    return ns, {"model": model, "host": ns.host, "port": ns.port,
                "served_names": tuple(ns.served_model_name or (model,)),
                "max_model_len": ns.max_model_len, "max_num_seqs": ns.max_num_seqs,
                "util": ns.gpu_memory_utilization, "block_size": ns.block_size,
                "tp": ns.tensor_parallel_size, "env": dict(env), "ignored": tuple(unknown),
                "api_keys": tuple(ns.api_key or [k for k in [env.get("VLLM_API_KEY")] if k])}


def env_values(env: Mapping[str, str], wanted: Mapping[str, tuple[str, Any]],
               given: Mapping[str, object] | None = None) -> dict[str, Any]:
    """The emulator's knobs: key -> (variable, default), converted to the default's type; a
    value in `given` (a `--sim-*` option) wins. UsageError for one that does not convert."""
    given = given or {}
    out = {}
    try:
        for key, (name, default) in wanted.items():
            raw = given.get(key)
            raw = raw if raw is not None and raw != "" else env.get(name) or None
            convert: Callable[[Any], Any] = int if default is None else type(default)
            out[key] = default if raw is None else convert(raw)
    except ValueError as err:
        raise UsageError(f"bad emulator setting: {err}") from None
    return out


def serve_main(args: Sequence[str], prog: str, parser: Callable[[], argparse.ArgumentParser],
               parse: Callable[[list[str], dict[str, str]], C],
               serve: Callable[[C], int]) -> int:
    """`--help`, the configuration (exit 2 on a usage error), then the server's exit code."""
    if "-h" in args or "--help" in args:
        parser().print_help()
        return 0
    try:
        cfg = parse(list(args), dict(os.environ))
    except UsageError as err:
        sys.stderr.write(f"{prog}: error: {err}\n")
        return 2
    except SystemExit as stop:  # argparse printed its own error
        return stop.code if isinstance(stop.code, int) else 2
    return serve(cfg)
