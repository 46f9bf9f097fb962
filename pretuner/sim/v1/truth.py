"""What only the emulator knows about vLLM 0.24: the largest pinned KV cache that truly works.

Pure: replays the shared boot and engine code with a silent log, so it cannot disagree with the
server. The load to survive: one max-length prompt, then as many as the KV cache holds, then a
burst of short requests as wide as max-num-seqs; for a vision-language model,
`pretuner.launch.images.validation_phases` with that burst. A tuner never calls these."""

from __future__ import annotations

import bisect
import io
from collections.abc import Sequence
from dataclasses import dataclass

from pretuner.launch.images import LoadPhase, TextRequest, image_shape, validation_phases
from pretuner.models.spec import ModelSpec
from pretuner.models.vision import VLLM_DEFAULT_MM_LIMIT
from pretuner.sim.kvcache import cache_layout
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1 import offload
from pretuner.sim.v1.boot import Booted, Sink, boot
from pretuner.sim.v1.chat import TEMPLATE_TOKENS
from pretuner.sim.v1.config import ENV, KV_DTYPES, parse
from pretuner.sim.v1.engine import EngineCore
from pretuner.sim.v1.inproc import Client, Times, drive, waves_of
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.units import MIB

VALIDATION_DECODE = 16  # what the tuner's validation generates per request
BURST_DECODE = 16  # what each request of the truth's burst generates


@dataclass(frozen=True, slots=True)
class Images:
    """A vision-language model's load: its image limit, the soak's length and seed."""

    limit: int | None = None  # --limit-mm-per-prompt image count (None: vLLM's 999)
    soak: int = 0
    seed: int = 0

    def argv(self) -> list[str]:
        return [] if self.limit is None else ["--limit-mm-per-prompt", f"image={self.limit}"]


def _argv(max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
          tp: int, kv_cache_dtype: str, enforce_eager: bool, extra: list[str]) -> list[str]:
    argv = ["model", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--block-size",
            str(block_size), "--tensor-parallel-size", str(tp), "--kv-cache-dtype",
            kv_cache_dtype, *extra]
    return argv + (["--enforce-eager"] if enforce_eager else [])


def _env(profile_name: str, seed: int, occupied_mib: int) -> dict[str, str]:
    return {ENV["profile"]: profile_name, ENV["seed"]: str(seed),
            ENV["occupied_mib"]: str(occupied_mib)}


def _boot(spec: ModelSpec, argv: list[str], env: dict[str, str]) -> Booted | None:
    """The server this command starts, booted with a log that prints nowhere."""
    return boot(parse(argv, env), Sink(L.V1Log(0, 0, io.StringIO()), 0), spec=spec)


def max_kv_bytes(spec: ModelSpec, profile_name: str, *, seed: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, block_size: int = 16,
                 tp: int = 1, kv_cache_dtype: str = "auto", enforce_eager: bool = False,
                 occupied_mib: int = 0, images: Images | None = None,
                 extra_args: Sequence[str] = (), burst: bool = True) -> int:
    """The largest pinned `--kv-cache-memory-bytes` (whole MiB) that starts and survives the
    worst-case load (a vision-language model's when `images` is given); 0 when none does.
    `extra_args`: more server flags (--quantization, --cpu-offload-gb...); `burst` False: the
    load without its wide short burst."""
    env = _env(profile_name, seed, occupied_mib)

    def works(kv_mib: int) -> bool:
        argv = _argv(max_model_len, max_num_seqs, max_num_batched_tokens, block_size, tp,
                     kv_cache_dtype, enforce_eager, ["--kv-cache-memory-bytes",
                                                     str(kv_mib * MIB), *extra_args])
        return survives(spec, argv, env, images, burst)

    # The smallest cache that holds one max-length sequence, and one that cannot fit.
    cache_dtype = KV_DTYPES.get(kv_cache_dtype, kv_cache_dtype)  # the server's reading of it
    per_token = cache_layout(spec, tp=tp, cache_dtype=cache_dtype).bytes_per_token
    lo = -(-max_model_len * per_token // MIB)
    hi = CUDA_PROFILES[profile_name].nvml_total_mib
    if not works(lo):
        return 0
    failing = bisect.bisect_left(range(lo + 1, hi), True, key=lambda mib: not works(mib))
    return (lo + failing) * MIB


def survives(spec: ModelSpec, argv: list[str], env: dict[str, str],
             images: Images | None, burst: bool = True) -> bool:
    """Whether this server command starts and survives the worst-case load."""
    booted = _boot(spec, [*argv, *images.argv()] if images is not None else argv, env)
    return booted is not None and _load_survives(spec, booted, images, burst)


def _load_survives(spec: ModelSpec, booted: Booted, images: Images | None,
                   burst: bool = True) -> bool:
    """The worst-case load through the in-process server's engine; False once a step ran
    out of memory."""
    mml = booted.max_model_len
    count = max(1, min(booted.max_num_seqs, booted.num_blocks * booted.card.block_size // mml))
    # The widest batch: a short request per sequence the engine runs at once (as many as its
    # step budget and its KV blocks, two each, allow), all decoding together.
    width = min(booted.max_num_seqs, booted.card.batched_tokens, booted.num_blocks // 2)
    wide = LoadPhase("burst", (TextRequest(booted.card.block_size, BURST_DECODE),) * width
                     if burst else ())
    if images is None or spec.vision is None:  # one max-length prompt, then `count` at once
        one = TextRequest(mml - 1, 1)
        waves = [LoadPhase("probe", (one,)), LoadPhase("load", (one,) * count), wide]
    else:
        shape = image_shape(spec.vision, VLLM_DEFAULT_MM_LIMIT if images.limit is None
                            else images.limit)
        decode = min(VALIDATION_DECODE, max(1, mml // 2))
        waves = waves_of(validation_phases(shape, mml, decode, count, images.soak,
                                           images.seed, TEMPLATE_TOKENS))
        waves.insert(2, wide)
    rec = Sink(L.V1Log(0, 0, io.StringIO()), 0)
    core, client = EngineCore(booted, rec.log), Client(rec.log, dev_mode=True)
    for wave in waves:
        rec.phase = wave.name
        drive(core, rec, client, wave, Times(lambda tokens: 0.0))
    return core.dead is None


def util_outcome(spec: ModelSpec, profile_name: str, *, util: float, seed: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 block_size: int = 16, tp: int = 1, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = False, occupied_mib: int = 0,
                 images: Images | None = None, extra_args: Sequence[str] = (),
                 load: bool = True) -> tuple[int, bool]:
    """A hand-chosen `--gpu-memory-utilization`: (the KV bytes (whole blocks) its profiling
    gives, 0 when the start fails (profiling, graph capture or warm-up); whether it survives
    the worst-case load, asked only with `load`)."""
    argv = _argv(max_model_len, max_num_seqs, max_num_batched_tokens, block_size, tp,
                 kv_cache_dtype, enforce_eager, ["--gpu-memory-utilization", str(util),
                                                 *(images.argv() if images else ()),
                                                 *extra_args])
    booted = _boot(spec, argv, _env(profile_name, seed, occupied_mib))
    if booted is None:
        return 0, False
    return booted.kv_bytes, load and _load_survives(spec, booted, images)


def decode_tokens_per_s(spec: ModelSpec, profile_name: str, *, tp: int = 1,
                        quantization: str | None = None, cpu_offload_gib: float = 0.0,
                        enforce_eager: bool = False) -> float:
    """One sequence's decode speed on the emulated card's clock (tokens/s, simulated): one
    step of one token with these weights knobs, as the server's clock times it."""
    loaded = offload.load(spec, profile_name, tp, quantization, cpu_offload_gib)
    return 1.0 / offload.clock(spec, profile_name, loaded, tp, enforce_eager).step_seconds(1)
