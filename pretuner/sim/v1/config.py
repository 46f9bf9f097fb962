"""`vllm serve`'s command line (vLLM 0.24) and the emulator's environment, parsed into a frozen
`V1Config`. Pure; the emulator's knobs come from `PRETUNER_SIM_*` variables only."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pretuner.sim.argv import ServerArgs, env_values, normalize_argv, parse_known, server_parser
from pretuner.sim.argv import UsageError as UsageError  # re-exported: the parse error
from pretuner.sim.memory import DEFAULT_SEED
from pretuner.sim.v1.memory import CUDA_PROFILES, DEFAULT_CUDA_PROFILE, CudaProfile
from pretuner.sim.v1.offload import HOST_ENV

KV_DTYPES = {"auto": "auto", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
KNOBS: dict[str, tuple[str, Any]] = {  # the emulator's settings: key -> (variable, default)
    "seed": ("PRETUNER_SIM_SEED", DEFAULT_SEED),
    "startup_s": ("PRETUNER_SIM_STARTUP_S", 1.0),
    "occupied_mib": ("PRETUNER_SIM_OCCUPIED_MIB", 0),
    "host_mib": (HOST_ENV, None),
    "time_scale": ("PRETUNER_SIM_TIME_SCALE", 1.0),
    "boot_noise_mib": ("PRETUNER_SIM_BOOT_NOISE_MIB", 0),
    # The engine's default max-num-seqs in place of vLLM's rule for the card: the tests' knob
    # (a 1,024-wide burst costs the machine running them seconds per launch).
    "max_num_seqs": ("PRETUNER_SIM_MAX_NUM_SEQS", None),
}
ENV = {"profile": "PRETUNER_SIM_PROFILE", **{key: name for key, (name, _) in KNOBS.items()}}
NON_DEFAULT_ORDER = (
    "host", "port", "api_key", "model", "max_model_len", "served_model_name", "load_format", "seed",
    "enforce_eager", "distributed_executor_backend", "pipeline_parallel_size",
    "tensor_parallel_size", "quantization", "block_size",
    "gpu_memory_utilization", "kv_cache_memory_bytes", "swap_space", "cpu_offload_gb",
    "kv_cache_dtype", "max_num_batched_tokens", "max_num_seqs", "limit_mm_per_prompt",
    "mm_processor_cache_gb")  # how vLLM orders its `non-default args`
# api_key among them in clear, as vLLM printed it before its PR #52523 (0.32 prints '***').
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def human_bytes(raw: str) -> int:
    """`--kv-cache-memory-bytes`: an integer, or K/M/G/T (powers of 1024; lower case: 1000)."""
    m = _SIZE.match(raw)
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid size {raw!r}: use bytes or e.g. 60G")
    number, unit = m.groups()
    base = 1000 if unit.islower() else 1024
    return int(float(number) * base ** _POWERS[unit.lower()])


def build_parser(prog: str = "vllm serve") -> argparse.ArgumentParser:
    p = server_parser(
        prog, "Emulated vLLM 0.24 OpenAI server on an emulated CUDA card (all memory figures "
        "are SIMULATED). Unknown flags are ignored.",
        "Emulator settings (env only): PRETUNER_SIM_PROFILE (" + ", ".join(CUDA_PROFILES)
        + "), PRETUNER_SIM_SEED, PRETUNER_SIM_STATE_DIR, PRETUNER_SIM_OCCUPIED_MIB, "
        "PRETUNER_SIM_STARTUP_S, PRETUNER_SIM_HOST_MIB (the emulated host's memory), "
        "PRETUNER_SIM_TIME_SCALE (1: the emulated card's own speed), PRETUNER_SIM_BOOT_NOISE_MIB "
        "(every other boot holds this much more); CUDA_VISIBLE_DEVICES as "
        "CUDA reads it.", length=human_bytes)
    p.add_argument("--kv-cache-memory-bytes", type=human_bytes, default=None)
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--cpu-offload-gb", type=float, default=0.0)
    p.add_argument("--swap-space", type=float, default=4.0)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--limit-mm-per-prompt", default=None)
    p.add_argument("--mm-processor-cache-gb", type=float, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", choices=("ray", "mp"), default=None)
    p.set_defaults(max_num_seqs=None)  # the card's (`batch_defaults`)
    return p


def batch_defaults(card: CudaProfile, env: Mapping[str, str]) -> tuple[int, int]:
    """vLLM 0.24's OpenAI server on this card: (max_num_seqs, max_num_batched_tokens) of 1024
    and 8192 on a GPU of at least 70 GiB (torch's total) that is not an A100, else 256, 2048;
    PRETUNER_SIM_MAX_NUM_SEQS sets the first."""
    large = card.torch_total_bytes >= 70 * 1024**3 and "a100" not in card.gpu_name.lower()
    seqs, batched = (1024, 8192) if large else (256, 2048)
    asked = env_values(env, {"max_num_seqs": KNOBS["max_num_seqs"]})["max_num_seqs"]
    if asked is not None and asked < 1:
        raise UsageError(f"{ENV['max_num_seqs']}={asked} must be at least 1")
    return (seqs if asked is None else asked), batched


def _mm_limits(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """vLLM's dotted form `--limit-mm-per-prompt.image=2` (or `... .image 2`), taken out of
    argv: (the rest, modality -> count text)."""
    rest: list[str] = []
    dotted: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        if arg.startswith("--limit-mm-per-prompt."):
            key, eq, value = arg.removeprefix("--limit-mm-per-prompt.").partition("=")
            dotted[key] = value if eq else next(it, "")
        else:
            rest.append(arg)
    return rest, dotted


def image_limit(raw: str | None, dotted: Mapping[str, str]) -> int | None:
    """The image count of --limit-mm-per-prompt (None: not given, vLLM's default)."""
    from pretuner.errors import BadInputError
    from pretuner.models.vision import parse_limit_mm_per_prompt

    text = raw if raw is not None else ",".join(f"{k}={v}" for k, v in dotted.items())
    if not text:
        return None
    try:
        return parse_limit_mm_per_prompt(text).get("image")
    except BadInputError as err:
        raise UsageError(f"argument --limit-mm-per-prompt: {err.message}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class V1Config(ServerArgs):
    """The server's command line and the emulator's settings."""

    max_num_batched_tokens: int
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str
    enforce_eager: bool
    load_format: str
    seed: int
    non_default: tuple[tuple[str, object], ...]
    sim_seed: int = DEFAULT_SEED
    visible: tuple[int, ...] | None = None
    image_limit: int | None = None  # --limit-mm-per-prompt image=N (None: vLLM's 999)
    mm_processor_cache_gib: float = 4.0  # --mm-processor-cache-gb (host memory)
    quantization: str | None = None
    cpu_offload_gib: float = 0.0
    swap_space_gib: float = 4.0
    host_mib: int | None = None  # None: the profile's host
    time_scale: float = 1.0
    pp: int = 1  # --pipeline-parallel-size
    backend: str | None = None  # --distributed-executor-backend (ray: RAY_ADDRESS's cluster)
    compiled_before: bool = False  # this configuration's torch.compile is in the cache

    @property
    def compile_key(self) -> str:
        """What vLLM 0.24 keys its torch.compile cache by, of what the emulator knows: the
        model and the shapes, --kv-cache-memory-bytes among them (its CacheConfig hash leaves
        out only --gpu-memory-utilization and derived counts), not the name or the port."""
        return repr((self.model, self.max_model_len, self.max_num_seqs,
                     self.max_num_batched_tokens, self.kv_cache_memory_bytes, self.kv_cache_dtype,
                     self.block_size, self.quantization, self.tp, self.pp))


def _visible(raw: str | None) -> tuple[int, ...] | None:
    if raw is None:
        return None
    try:
        return tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"CUDA_VISIBLE_DEVICES={raw!r} is not a list of GPU indices") from None


def _given(argv: Sequence[str], dests: Iterable[str]) -> set[str]:
    """The options a command line sets explicitly, as argparse dest names."""
    parser, unset = build_parser(), object()
    parser.set_defaults(**dict.fromkeys(dests, unset))
    return {k for k, v in vars(parser.parse_known_args(list(argv))[0]).items() if v is not unset}


def _non_default(ns: argparse.Namespace, model: str,
                 given: set[str]) -> tuple[tuple[str, object], ...]:
    """vLLM's `non-default args: {...}`: what the command line set, in vLLM's order."""
    values = {**vars(ns), "model": model}
    out = [("model_tag", ns.model_tag)] if ns.model_tag else []
    return tuple(out + [(name, values[name]) for name in NON_DEFAULT_ORDER
                        if name in given or name == "model"])


def parse(argv: Sequence[str], env: Mapping[str, str]) -> V1Config:
    """argv after `vllm serve` + environment -> config; UsageError for what argparse accepts
    but the emulator cannot run."""
    rest, dotted = _mm_limits(normalize_argv(argv))
    ns, args = parse_known(build_parser(), rest, env,
                           "a model is required: vllm serve MODEL [options]")
    profile = env.get(ENV["profile"]) or DEFAULT_CUDA_PROFILE
    if profile not in CUDA_PROFILES:
        raise UsageError(f"{ENV['profile']}={profile!r} is not a CUDA profile; choose one of: "
                         f"{', '.join(CUDA_PROFILES)}")
    knobs = env_values(env, KNOBS)
    host_mib = knobs["host_mib"]
    seqs, batched = batch_defaults(CUDA_PROFILES[profile], env)
    if ns.max_num_seqs is None:
        args["max_num_seqs"] = seqs
    return V1Config(
        **args, max_num_batched_tokens=ns.max_num_batched_tokens or batched,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        kv_cache_dtype=KV_DTYPES[ns.kv_cache_dtype], enforce_eager=ns.enforce_eager,
        load_format=ns.load_format, seed=ns.seed if ns.seed is not None else 0,
        non_default=_non_default(ns, args["model"], _given(rest, vars(ns))), profile=profile,
        sim_seed=knobs["seed"], startup_s=max(0.0, knobs["startup_s"]),
        occupied_mib=max(0, knobs["occupied_mib"]),
        visible=_visible(env.get("CUDA_VISIBLE_DEVICES")),
        image_limit=image_limit(ns.limit_mm_per_prompt, dotted),
        mm_processor_cache_gib=(4.0 if ns.mm_processor_cache_gb is None
                                else max(0.0, ns.mm_processor_cache_gb)),
        quantization=ns.quantization,
        cpu_offload_gib=max(0.0, ns.cpu_offload_gb), swap_space_gib=max(0.0, ns.swap_space),
        host_mib=host_mib if host_mib is None else max(1, host_mib),
        time_scale=max(0.0, knobs["time_scale"]),
        boot_noise_mib=max(0, knobs["boot_noise_mib"]),
        pp=ns.pipeline_parallel_size, backend=ns.distributed_executor_backend)
