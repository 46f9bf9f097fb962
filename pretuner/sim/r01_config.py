"""The emulated r0.1 server's configuration: its command line (vLLM 0.6's flags, `--sim-*`
knobs) and environment, parsed into one `ServeConfig`. Pure: no I/O."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pretuner.sim import memory as mem
from pretuner.sim.argv import ServerArgs, env_values, normalize_argv, parse_known, server_parser
from pretuner.sim.argv import UsageError as UsageError  # re-exported: the parse error
from pretuner.sim.logs import POOL_FORMATS

VLLM_VERSION = "0.6.6.post1"
DEFAULT_STARTUP_S = 1.0
DEFAULT_TEARDOWN_S = 0.5
_KV_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
              "int8": "int8", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}

# The emulator's knobs, in --help's order: key -> (variable, default, help). Each is also a
# `--sim-*` option, which wins over the variable.
SIM: dict[str, tuple[str, Any, str]] = {
    "profile": ("PRETUNER_SIM_PROFILE", mem.DEFAULT_PROFILE,
                f"card profile: {', '.join(mem.PROFILES)} (default {mem.DEFAULT_PROFILE})"),
    "seed": ("PRETUNER_SIM_SEED", mem.DEFAULT_SEED,
             f"perturbs the hidden coefficients (default {mem.DEFAULT_SEED})"),
    "truth": ("PRETUNER_SIM_TRUTH", "", "write what only the emulator knows (JSON) to this file"),
    "pool_format": ("PRETUNER_SIM_POOL_FORMAT", "2.5", "MindSpore pool dump format (default 2.5)"),
    "startup_s": ("PRETUNER_SIM_STARTUP_S", DEFAULT_STARTUP_S,
                  f"startup duration (default {DEFAULT_STARTUP_S})"),
    "teardown_s": ("PRETUNER_SIM_TEARDOWN_S", DEFAULT_TEARDOWN_S,
                   f"device release time at a graceful stop (default {DEFAULT_TEARDOWN_S})"),
    "weights_format": ("PRETUNER_SIM_WEIGHTS_FORMAT", "",
                       "checkpoint format from the model spec (default: native dtype)"),
    "nodes": ("PRETUNER_SIM_NODES", 1, "nodes the TP group spans (default 1)"),
    "rank_skew": ("PRETUNER_SIM_RANK_SKEW", "", "RANK=FACTOR[,...]: multiply these ranks' "
                  "activations (the worst or an OOMing rank where a test wants it)"),
    "occupied_mib": ("PRETUNER_SIM_OCCUPIED_MIB", 0,
                     "another tenant's process holds this much of every card (MiB)"),
    "boot_noise_mib": ("PRETUNER_SIM_BOOT_NOISE_MIB", 0,
                       "every other boot (sharing PRETUNER_SIM_STATE_DIR) holds this much more "
                       "on every rank (MiB)"),
    "ray_address": ("PRETUNER_SIM_RAY_ADDRESS", "", "place the ranks on this Ray cluster "
                    "(default: RAY_ADDRESS with --distributed-executor-backend ray, as vLLM does)"),
}
NODE_LOG_DIRS_ENV = "PRETUNER_SIM_NODE_LOG_DIRS"


def build_parser(prog: str = "pretuner sim serve") -> argparse.ArgumentParser:
    p = server_parser(
        prog,
        "Emulated vLLM-MindSpore r0.1 (vLLM 0.6.6) OpenAI server on an emulated Ascend card. "
        "Takes the real command line and environment (ASCEND_TOTAL_MEMORY_GB, "
        "vLLM_MODEL_MEMORY_USE_GB, GLOG_v, GLOG_logtostderr, GLOG_log_dir, "
        "ASCEND_RT_VISIBLE_DEVICES) and prints the real log lines, including the memory pool "
        "dump with `actual peak used mem` at a graceful stop. All memory figures are "
        "SIMULATED. Unknown flags are ignored.",
        f"Sim-only options also read env vars: {', '.join(v for v, _, _ in SIM.values())}; "
        "PRETUNER_SIM_STATE_DIR is where the server publishes HBM use for `npu-smi`, "
        f"{NODE_LOG_DIRS_ENV} overrides GLOG_log_dir/node<k> per node.",
        model_help="model (registry name or local HF folder)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--distributed-executor-backend", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--enable-chunked-prefill", nargs="?", const="true", default=None,
                   type=_bool_arg)
    sim = p.add_argument_group("emulator (not part of the real command line)")
    for key, (_, default, text) in SIM.items():
        flags = [f"--sim-{key.replace('_', '-')}"] + (["--truth"] if key == "truth" else [])
        sim.add_argument(*flags, dest=f"sim_{key}", type=type(default), default=None, help=text,
                         choices=POOL_FORMATS if key == "pool_format" else None)
    return p


def _bool_arg(raw: str) -> bool:
    """vLLM's `--enable-chunked-prefill [BOOL]`."""
    lowered = raw.lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {raw!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig(ServerArgs):
    """Everything the emulated server needs, from the command line and the environment."""

    max_num_batched_tokens: int | None
    pp: int
    kv_dtype: str
    seed: int
    truth: str | None
    pool_format: str
    teardown_s: float
    weights_format: str | None
    nodes: int
    rank_skew: dict[int, float] = field(default_factory=dict)
    ray_address: str | None = None  # ranks placed on this Ray cluster's nodes
    chunked_prefill: bool | None = None  # None: vLLM's default (on above 32K)


def parse(argv: Sequence[str], env: dict[str, str]) -> ServeConfig:
    """Command line + environment -> config. Raises UsageError for sim options out of range."""
    ns, args = parse_known(build_parser(), normalize_argv(argv), env,
                           "a model is required: pass it as --model M (or positionally)")
    knobs = env_values(env, {key: (var, default) for key, (var, default, _) in SIM.items()},
                       {key: getattr(ns, f"sim_{key}") for key in SIM})
    if knobs["profile"] not in mem.PROFILES:
        raise UsageError(f"unknown card profile {knobs['profile']!r}; choose one of: "
                         f"{', '.join(mem.PROFILES)}")
    if knobs["pool_format"] not in POOL_FORMATS:
        raise UsageError(f"unknown pool format {knobs['pool_format']!r}; choose one of: "
                         f"{', '.join(POOL_FORMATS)}")
    ray_address = knobs["ray_address"] or (
        env.get("RAY_ADDRESS") if ns.distributed_executor_backend == "ray" else None) or None
    return ServeConfig(
        **args, max_num_batched_tokens=ns.max_num_batched_tokens, pp=ns.pipeline_parallel_size,
        kv_dtype=_KV_DTYPES.get(ns.kv_cache_dtype, "auto"), profile=knobs["profile"],
        seed=knobs["seed"], truth=knobs["truth"] or None, pool_format=knobs["pool_format"],
        startup_s=max(0.0, knobs["startup_s"]), teardown_s=max(0.0, knobs["teardown_s"]),
        weights_format=knobs["weights_format"] or None, nodes=max(1, knobs["nodes"]),
        rank_skew=_rank_skew(knobs["rank_skew"]), ray_address=ray_address,
        chunked_prefill=ns.enable_chunked_prefill, occupied_mib=max(0, knobs["occupied_mib"]),
        boot_noise_mib=max(0, knobs["boot_noise_mib"]),
    )


def _rank_skew(raw: str) -> dict[int, float]:
    out = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        rank, _, factor = part.partition("=")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            raise UsageError(f"bad rank skew {part!r}; use RANK=FACTOR, e.g. 12=1.5") from None
        if not out[int(rank)] > 0:
            raise UsageError(f"bad rank skew {part!r}; the factor must be > 0")
    return out
