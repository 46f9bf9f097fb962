"""The emulated vLLM 0.24 start-up: argument checks, device, weights, profiling, KV cache,
graph capture, warm-up; the same log lines and the same failures as the real server.

Shared by the subprocess server and the in-process run; what differs between them (publishing,
holding, sleeping) is in the `Sink` each gives it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath

from pretuner.errors import PretunerError
from pretuner.models import ModelSpec, resolve
from pretuner.sim.argv import Refused
from pretuner.sim.kvcache import cache_layout
from pretuner.sim.state import Published, remember_compiled
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1 import offload
from pretuner.sim.v1.config import V1Config
from pretuner.sim.v1.memory import CUDA_PROFILES, Alloc, V1Card, first_failure, perturbed
from pretuner.sim.v1.mm import VisionCard, vision_card
from pretuner.stopflag import StopFlag
from pretuner.units import GIB, MIB

HOLD_S = 0.1  # a server process holds every published level at least this long


class Stopped(Exception):
    """A stop signal came during start-up."""


@dataclass
class Sink:
    """Where the start-up and the engine report the process's memory: each phase's peak and
    last NVML figure; a server process (`stop` given) also publishes each level for the device
    tools, holds it HOLD_S so a sampler in another process sees it, and sleeps its start-up."""

    log: L.V1Log
    floor_mib: int  # NVML used without this process (idle + tenant)
    phase: str = "start"
    peaks: dict[str, int] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)
    stop: StopFlag | None = None
    state: Path = Path()
    devices: tuple[int, ...] = ()
    files: Published = field(default_factory=Published)
    publish: Callable[[int], None] | None = None  # on a Ray cluster: every node's GPUs (MiB)

    def level(self, process_bytes: int) -> None:
        mib = -(-process_bytes // MIB)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.floor_mib + mib)
        self.last[self.phase] = self.floor_mib + mib
        if self.stop is not None:
            if self.publish is not None:
                self.publish(mib)
            for device in self.devices:
                self.files.hold(self.state, "cuda", 0, device, mib)
            time.sleep(HOLD_S)

    def compiled(self, key: str) -> None:
        """This boot compiled configuration `key`: a served boot keeps it in its card's cache."""
        if self.stop is not None:
            remember_compiled(self.state, key)

    def pause(self, seconds: float) -> None:
        if self.stop is not None and self.stop.wait(seconds):
            raise Stopped


def devices_for(cfg: V1Config) -> list[int] | None:
    """The GPUs the ranks use (one each, in CUDA_VISIBLE_DEVICES order); None if too few. On
    Ray (`--distributed-executor-backend ray`) the ranks' GPUs are Ray's: none here."""
    if cfg.backend == "ray":
        return []
    visible = list(cfg.visible) if cfg.visible is not None else list(
        range(CUDA_PROFILES[cfg.profile].gpus_per_node))
    return visible[:cfg.tp] if len(visible) >= cfg.tp else None


@dataclass(frozen=True, slots=True)
class Booted:
    """What the engine starts serving with (per rank; every rank is identical)."""

    card: V1Card
    max_model_len: int
    max_num_seqs: int
    kv_bytes: int
    num_blocks: int
    fixed_bytes: int  # context + weights + persistent + KV + graph pool
    reserved_bytes: int  # torch's cached transients after the warm-up
    room_bytes: int  # what transients may take: capacity - fixed
    total_bytes: int  # torch's total capacity
    capacity_bytes: int  # torch total minus what others hold on the GPU
    non_torch_bytes: int
    private_bytes: int
    clock: offload.Clock  # how long a step takes on the emulated card
    vision: VisionCard | None = None  # a vision-language model's tower and budget
    processor_cache_bytes: int = 0  # --mm-processor-cache-gb (host memory)


def resolve_model(name: str) -> ModelSpec:
    """A registry name or HF folder; a missing folder like `models/qwen3-8b` by its name."""
    try:
        return resolve(name)
    except PretunerError:
        base = PurePath(name).name
        if base and base != name:
            return resolve(base)
        raise


def first_stage(spec: ModelSpec, pp: int) -> tuple[ModelSpec, float]:
    """The busiest pipeline stage as a model of its own layers, and its share of the weights:
    vLLM's `get_pp_indices` gives the layers left over to the earliest stages."""
    if pp <= 1:
        return spec, 1.0
    if pp > spec.num_layers:
        raise Refused("ValueError", f"The number of layers ({spec.num_layers}) must be at least "
                      f"the pipeline parallel size ({pp}).", "config")
    layers = -(-spec.num_layers // pp)
    return replace(spec, num_layers=layers), layers / spec.num_layers


def _compile_s(cfg: V1Config) -> str:
    """torch.compile's time at start-up: loaded from the cache, or compiled."""
    return "2.35" if cfg.compiled_before else "6.25"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def oom(card_total: int, capacity: int, in_use: int, alloc: Alloc, *, non_torch: int,
        stage: str, private: int = 0, unallocated: int = 0) -> Refused:
    text = L.oom_text(gpu=0, alloc=alloc.size, total=card_total, free=capacity - in_use,
                      in_use=in_use, non_torch=non_torch, private=private,
                      unallocated=unallocated)
    return Refused("torch.OutOfMemoryError", text, stage)


def check_args(cfg: V1Config, spec: ModelSpec) -> int:
    """vLLM's own argument checks (APIServer side); returns max_model_len."""
    derived = spec.max_position_embeddings
    mml = cfg.max_model_len or derived
    if mml > derived:
        raise Refused("pydantic_core._pydantic_core.ValidationError",
                      f"1 validation error for ModelConfig\n  Value error, User-specified "
                      f"max_model_len ({mml}) is greater than the derived max_model_len "
                      f"(max_position_embeddings={derived} or model_max_length=None in model's "
                      "config.json). To allow overriding this maximum, set the env var "
                      "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.", "config")
    if not 0 < cfg.util <= 1:
        raise Refused("ValueError", "GPU memory utilization must be within (0, 1]. "
                      f"Got {cfg.util}.", "config")
    if cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise Refused("ValueError", f"max_num_batched_tokens "
                      f"({cfg.max_num_batched_tokens}) must be greater than or equal to "
                      f"max_num_seqs ({cfg.max_num_seqs}).", "config")
    if spec.num_heads % cfg.tp:
        raise Refused("ValueError", f"Total number of attention heads "
                      f"({spec.num_heads}) must be divisible by tensor parallel size "
                      f"({cfg.tp}).", "config")
    cache_layout(spec, tp=cfg.tp, cache_dtype=cfg.kv_cache_dtype)  # the KV heads' split
    return mml


def _api_preamble(log: L.V1Log, cfg: V1Config, spec: ModelSpec) -> None:
    banner = ["", "       █     █     █▄   ▄█",
              f" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {L.VERSION}",
              f"  █▄█▀ █     █     █     █  model   {cfg.model}",
              "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀", ""]
    for line in banner:
        log.api("api_utils.py:339", line)
    args = ", ".join(f"{k!r}: {v!r}" for k, v in cfg.non_default)
    log.api("api_utils.py:273", "non-default args: {" + args + "}")
    family = spec.name.split("-")[0].replace(".", "")
    arch = spec.extra.get("architecture") or f"{family[:1].upper()}{family[1:]}ForCausalLM"
    log.api("model.py:598", f"Resolved architecture: {arch}")


def boot(cfg: V1Config, sink: Sink, *, others_bytes: int = 0,
         spec: ModelSpec | None = None) -> Booted | None:
    """Start the emulated engine; None when it failed (already printed, exit code 1).

    `spec` stands for the model `cfg.model` names (the truth functions pass it directly)."""
    log = sink.log
    if devices_for(cfg) is None:
        log.raw(L.API, ["Traceback (most recent call last):", "ValueError: The number of "
                        "required GPUs exceeds the total number of available GPUs in the "
                        "placement group."])
        return None
    if spec is None:
        try:
            spec = resolve_model(cfg.model)
        except PretunerError as err:
            log.raw(L.API, ["Traceback (most recent call last):", f"OSError: {err.message}"])
            return None
    _api_preamble(log, cfg, spec)
    try:  # the API server's own checks
        mml = check_args(cfg, spec)
        stage, share = first_stage(spec, cfg.pp)
        loaded = offload.load(spec, cfg.profile, cfg.tp, cfg.quantization, cfg.cpu_offload_gib)
        warned = offload.swap_warning(cfg.swap_space_gib, cfg.tp,
                                      offload.host_total_bytes(cfg.profile, cfg.host_mib))
    except Refused as err:
        log.raw(L.API, ["Traceback (most recent call last):", f"{err.exc_type}: {err.message}"])
        return None
    if warned:
        log.api("config.py:388", warned, level="WARNING")
    log.api("model.py:1725", f"Using max model len {mml}")
    log.api("scheduler.py:252", "Chunked prefill is enabled with max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens}.")
    log.api("vllm.py:1006", "Asynchronous scheduling is enabled.")
    try:
        return _engine_start(cfg, sink, stage, mml, others_bytes, loaded, share)
    except Refused as err:
        if err.where == "killed":  # SIGKILL (the host's OOM killer): the engine prints nothing
            log.raw(L.API, L.api_failure_lines(err.message))
            return None
        body, raw = L.start_failure_lines(err.where, err.exc_type, err.message)
        log.block(L.CORE, "ERROR", L.WHERE_START, body)
        log.raw(L.CORE, raw)
        log.raw(L.API, L.api_failure_lines())
        return None


def _engine_start(cfg: V1Config, sink: Sink, spec: ModelSpec, mml: int,
                  others_bytes: int, loaded: offload.Loaded, share: float = 1.0) -> Booted:
    """`spec` is the busiest pipeline stage's model, `share` its part of the weights."""
    log, step_s = sink.log, cfg.startup_s / 8
    profile = CUDA_PROFILES[cfg.profile]
    # All the stage's ranks, less offload
    on_cards = int((loaded.total_bytes - loaded.offloaded_bytes * cfg.tp) * share)
    card = V1Card(spec, on_cards, perturbed(cfg.sim_seed), cfg.tp, cfg.kv_cache_dtype,
                  cfg.block_size, cfg.max_num_batched_tokens)
    context = (profile.context_mib + cfg.boot_noise_mib) * MIB  # this boot's noise, if any
    total = profile.torch_total_bytes
    capacity = total - cfg.occupied_mib * MIB - others_bytes
    non_torch = context + int(0.43 * card.persistent_bytes)
    log.core("core.py:114", f"Initializing a V1 LLM engine (v{L.VERSION}) with config: "
             f"model='{cfg.model}', tokenizer='{cfg.model}', dtype=torch.{spec.dtype}, "
             f"max_seq_len={mml}, load_format={cfg.load_format}, tensor_parallel_size={cfg.tp}, "
             f"enforce_eager={cfg.enforce_eager}, kv_cache_dtype={cfg.kv_cache_dtype}, "
             f"device_config=cuda, seed={cfg.seed}, served_model_name={cfg.served_names[0]}, "
             "enable_prefix_caching=True, enable_chunked_prefill=True")
    log.core("parallel_state.py:1588", f"world_size={cfg.tp * cfg.pp} rank=0 local_rank=0 "
             "distributed_init_method=tcp://127.0.0.1:41955 backend=nccl")
    sink.pause(step_s)
    sink.level(context)
    free = capacity - context
    requested = int(cfg.util * total)
    if free < requested:
        raise Refused("ValueError", f"Free memory on device cuda:0 ({_gib(free)}/"
                      f"{_gib(total)} GiB) on startup is less than desired GPU memory utilization "
                      f"({cfg.util}, {_gib(requested)} GiB). Decrease GPU memory utilization or "
                      "reduce GPU memory used by other processes.", "free")
    if not card.moe:  # an MoE model gets the V1 runner (`memory`'s docstring)
        log.core("gpu_worker.py:331", "Using V2 Model Runner")
        log.core("model_runner.py:281", "Loading model from scratch...")
    log.core("cuda.py:480", "Using FLASH_ATTN attention backend out of potential backends: "
             "['FLASH_ATTN', 'TRITON_ATTN', 'FLEX_ATTENTION'].")
    if loaded.quant is not None and loaded.quant.method == "bitsandbytes":
        log.core("bitsandbytes_loader.py:725", "Loading weights with BitsAndBytes "
                 "quantization. May take a while ...")
    host_free = offload.host_available_bytes(cfg.profile, cfg.host_mib)
    if offload.PROCESS_HOST_MIB * MIB + loaded.offloaded_bytes > host_free:  # the host's OOM
        raise Refused("", "{'EngineCore_DP0': -9}", "killed")
    if context + card.weights_bytes > capacity:
        layer = Alloc("weights", 0, card.weights_bytes // max(1, spec.num_layers))
        raise oom(total, capacity, capacity - layer.size // 2, layer, non_torch=context,
                  stage="load")
    sink.pause(step_s)
    sink.level(context + card.weights_bytes)
    runner = ("gpu_model_runner.py:5255", " memory") if card.moe else ("model_runner.py:302", "")
    log.core(runner[0], f"Model loading took {_gib(card.weights_bytes)} GiB{runner[1]} and "
             f"{1.2 + card.weights_bytes / GIB / 7.5:.6f} seconds")
    if not cfg.enforce_eager:  # the cache holds this configuration, or it compiles anew
        graphs = f"compile range (1, {cfg.max_num_batched_tokens})"
        if cfg.compiled_before:
            log.core("backends.py:292", f"Directly load the compiled graph(s) for {graphs} "
                     "from the cache, took 1.69 s")
        else:
            log.core("backends.py:1148", "Dynamo bytecode transform time: 3.59 s")
            log.core("backends.py:393", f"Compiling a graph for {graphs} takes 2.66 s")
            sink.compiled(cfg.compile_key)
        log.core("monitor.py:53", f"torch.compile took {_compile_s(cfg)} s in total")

    # The dummy step of max_num_batched_tokens tokens (the profile run; in util mode its peak
    # is the non-KV figure), after the encoder's dummy images for a vision-language model.
    base = card.base_bytes(context)
    vision = None if spec.vision is None else vision_card(
        spec.vision, tp=cfg.tp, dtype_bytes=spec.dtype_bytes, seed=cfg.sim_seed,
        image_limit=cfg.image_limit, max_model_len=mml, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens)
    profile_bytes = card.profile_activation_bytes(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    if vision is not None:
        if vision.budget_tokens:
            log.core("model_runner.py:4415", f"Encoder cache will be initialized with a budget "
                     f"of {vision.budget_tokens} tokens, and profiled with {vision.profiled} "
                     "image items of the maximum feature size.")
        profile_bytes = vision.profile_bytes(profile_bytes)
    dummy = Alloc("profile", base, profile_bytes)
    if base + dummy.size > capacity:
        raise oom(total, capacity, base, dummy, non_torch=non_torch, stage="warmup")
    sink.pause(step_s)
    sink.level(base + dummy.size)
    sink.level(base)
    log.core("monitor.py:81", "Initial profiling/warmup run took "
             f"{0.1 + cfg.max_num_batched_tokens / 16000:.2f} s")
    kv = _kv_budget(cfg, card, log, requested, free, profile_bytes)
    tokens = check_kv(kv, card, mml)
    blocks = tokens // cfg.block_size
    log.core("kv_cache_utils.py:2146", f"GPU KV cache size: {tokens:,} tokens")
    log.core("kv_cache_utils.py:2147", f"Maximum concurrency for {mml:,} tokens per request: "
             f"{tokens / mml:.2f}x")
    kv_bytes = blocks * card.block_bytes
    if base + kv_bytes > capacity:
        layer = Alloc("kv", base, kv_bytes // spec.num_layers)
        done = (capacity - base) // layer.size
        raise oom(total, capacity, base + done * layer.size, layer, non_torch=non_torch,
                  stage="kv")
    sink.pause(step_s)
    sink.level(base + kv_bytes)

    fixed, private = base + kv_bytes, 0
    if not cfg.enforce_eager:
        fixed, private = _capture(cfg, sink, card, fixed, capacity, total, non_torch)
    room = capacity - fixed
    warm = card.warmup(cfg.max_num_seqs)
    bad = first_failure(warm, 0, room)
    reached = warm if bad is None else warm[:warm.index(bad)]
    for a in reached:
        sink.level(fixed + a.live_before + a.size)
    if bad is not None:
        stage = "sampler" if bad.what.startswith("sampler") else "warmup"
        raise oom(total, capacity, fixed + bad.live_before, bad, non_torch=non_torch,
                  private=private, unallocated=int(0.09 * bad.live_before), stage=stage)
    reserved = max(a.live_before + a.size for a in warm)
    sink.pause(step_s)
    compile_note = "" if cfg.enforce_eager else f" (compilation: {_compile_s(cfg)} s)"
    log.core("core.py:337", "init engine (profile, create kv cache, warmup model) took "
             f"{cfg.startup_s:.2f} s{compile_note}")
    return Booted(card, mml, cfg.max_num_seqs, kv_bytes, blocks, fixed, reserved, room, total,
                  capacity, non_torch, private,
                  offload.clock(spec, cfg.profile, loaded, cfg.tp, cfg.enforce_eager), vision,
                  int(cfg.mm_processor_cache_gib * GIB))


def _kv_budget(cfg: V1Config, card: V1Card, log: L.V1Log, requested: int, free: int,
               profile_bytes: int) -> int:
    """The KV bytes: util minus profiling's non-KV figure, or the pinned bytes as given."""
    if cfg.kv_cache_memory_bytes is None:
        graphs = 0 if cfg.enforce_eager else card.graph_estimate_bytes
        if graphs:
            log.core("gpu_model_runner.py:6588", f"Estimated CUDA graph memory: {_gib(graphs)} "
                     "GiB total")
        kv = requested - (card.weights_bytes + card.persistent_bytes + profile_bytes + graphs)
        log.core("gpu_worker.py:508", f"Available KV cache memory: {_gib(kv)} GiB")
        return kv
    kv = cfg.kv_cache_memory_bytes
    log.core("gpu_worker.py:429", f"Initial free memory {_gib(free)} GiB, reserved "
             f"{round(kv / GIB, 2)} GiB memory for KV Cache as specified by "
             "kv_cache_memory_bytes config and skipped memory profiling. This does not respect "
             "the gpu_memory_utilization config. Only use kv_cache_memory_bytes config when you "
             "want manual control of KV cache memory size. If OOM'ed, check the difference of "
             "initial free memory between the current run and the previous run where "
             "kv_cache_memory_bytes is suggested and update it correspondingly.")
    return kv


def check_kv(kv: int, card: V1Card, mml: int) -> int:
    """vLLM's checks on the KV budget; returns its tokens (whole blocks)."""
    tokens = card.kv_tokens(kv)
    if tokens <= 0:
        raise Refused("ValueError", "No available memory for the cache blocks. Try "
                      "increasing `gpu_memory_utilization` when initializing the engine.", "config")
    if mml > tokens:
        need = mml * card.kv_bytes_per_token
        raise Refused("ValueError", f"To serve at least one request with the models's "
                      f"max seq len ({mml}), ({_gib(need)} GiB KV cache is needed, which is "
                      f"larger than the available KV cache memory ({_gib(kv)} GiB). Based on the "
                      f"available memory, the estimated maximum model length is {tokens}. Try "
                      "increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
                      "initializing the engine.", "config")
    return tokens


def _capture(cfg: V1Config, sink: Sink, card: V1Card, fixed: int, capacity: int, total: int,
             non_torch: int) -> tuple[int, int]:
    """CUDA-graph capture: PIECEWISE then FULL, the largest FULL size decides."""
    log = sink.log
    g = card.graph_capture()
    private = card.graph_private_bytes()
    log.raw(L.CORE, ["Capturing CUDA graphs (PIECEWISE): 100%|██████████| 51/51 "
                     "[00:03<00:00, 15.80it/s]"])
    sink.pause(cfg.startup_s / 8)
    if fixed + g.live_before > capacity:  # the pool and scratch themselves do not fit
        held = Alloc("graph", 0, g.live_before)
        raise oom(total, capacity, fixed, held, non_torch=non_torch, stage="graph")
    if fixed + g.live_before + g.size > capacity:
        sink.level(fixed + g.live_before)
        log.raw(L.CORE, ["Capturing CUDA graphs (FULL):   2%|▏         | 1/51 "
                         "[00:00<00:05,  8.46it/s]"])
        raise oom(total, capacity, fixed + g.live_before, g, non_torch=non_torch,
                  private=private, unallocated=int(0.344 * (g.live_before - private)),
                  stage="graph")
    sink.level(fixed + g.live_before + g.size)
    log.raw(L.CORE, ["Capturing CUDA graphs (FULL): 100%|██████████| 51/51 "
                     "[00:03<00:00, 12.81it/s]"])
    pool = card.graph_pool_bytes
    sink.level(fixed + pool)
    log.core("model_runner.py:726", f"Graph capturing finished in 8 secs, took "
             f"{_gib(pool)} GiB")
    return fixed + pool, private
