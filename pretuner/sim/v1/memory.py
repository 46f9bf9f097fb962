"""The emulated CUDA card's memory under vLLM 0.24 (V1 engine): every coefficient lives here.

Pure. Bytes per rank unless the name says MiB; the numbers are *simulated*, calibrated so that
seed 0 on `h100-80` replays the real Qwen3-8B runs under ../shared/real-logs/vllm-0.24-h100/
(outcome, KV figures and NVML peaks). NVML counts the driver's idle reservation, other tenants,
then this process: CUDA context, weights, persistent buffers, KV cache, CUDA-graph pool and
torch's cached transients (kept reserved, so NVML only grows). Profiling (util mode) sees only
a dummy step of max_num_batched_tokens: not graph capture, warm-up, the sampler's logits nor a
real step's workspace. That gap is why util 0.98 passes profiling and dies in graph capture."""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.models.spec import ModelSpec
from pretuner.sim.kvcache import CacheLayout, cache_layout
from pretuner.sim.memory import DEFAULT_SEED, perturb
from pretuner.units import MIB

ALLOC_ROUND = 2 * MIB  # torch rounds large allocations up to 2 MiB
_REF_LAYERS_X_HIDDEN = 36 * 4096  # Qwen3-8B, the calibration model
_REF_HIDDEN = 4096
_REF_BATCHED_TOKENS = 8192  # the step budget of every calibration run but F


@dataclass(frozen=True, slots=True)
class CudaProfile:
    """One kind of GPU as NVML and torch see it."""

    name: str
    gpu_name: str
    nvml_total_mib: int
    idle_mib: int  # NVML used on an idle GPU (driver reservation)
    context_mib: int  # a CUDA context of a vLLM worker
    gpus_per_node: int = 8
    power_w: int = 69
    power_cap_w: int = 700

    @property
    def torch_total_bytes(self) -> int:
        """torch's "total capacity": what NVML reports minus the idle reservation."""
        return (self.nvml_total_mib - self.idle_mib) * MIB


CUDA_PROFILES: dict[str, CudaProfile] = {
    p.name: p
    for p in (
        # Calibrated on the real H100 80GB HBM3 logs: 81559 MiB total, 480 MiB idle,
        # "Initial free memory 78.66 GiB" (the context takes ~532 MiB).
        CudaProfile("h100-80", "NVIDIA H100 80GB HBM3", 81559, 480, 532),
        # Plausible smaller cards with the same structure (simulated, never measured).
        CudaProfile("cuda-24", "NVIDIA L4", 23034, 290, 420, power_w=16, power_cap_w=72),
        CudaProfile("cuda-32", "Tesla V100-SXM2-32GB", 32768, 310, 450, power_w=42,
                    power_cap_w=300),
        CudaProfile("cuda-64", "NVIDIA A100-SXM4-64GB", 65536, 420, 500, power_w=58,
                    power_cap_w=400),
        # The field note's 20 GB card (its nvidia-smi: 20480MiB, 26W / 320W idle).
        CudaProfile("cuda-20", "NVIDIA GeForce RTX 3080", 20480, 260, 400, power_w=26,
                    power_cap_w=320),
    )
}
DEFAULT_CUDA_PROFILE = "h100-80"


@dataclass(frozen=True, slots=True)
class Coefficients:
    """The hidden coefficients (see the module docstring for what each one is)."""

    load_extra_mib: float = 14.0
    persistent_mib: float = 617.0
    profile_hidden: float = 0.5  # profile activation = T * dtype * (3 * I/tp + this * H)
    graph_pool_mib: float = 1034.0  # what "Graph capturing finished ... took" reports
    graph_private_peak_mib: float = 608.0  # pool in use when the largest FULL graph captures
    graph_scratch_mib: float = 922.0  # capture scratch held beside it (freed afterwards)
    graph_alloc_mib: float = 248.0  # the largest FULL graph's attention workspace
    warmup_mib: float = 640.0  # kernel warm-up's dummy batch, kept in torch's cache
    sampler_copies: float = 1.0  # fp32 logits rows per dummy request (max_num_seqs) warming up
    sampler_extra: float = 0.52  # softmax/sort temporaries, as a share of those logits
    step_fixed_mib: float = 1030.0  # per-step workspace a real step holds, profiling does not
    step_hidden: float = 2.0  # bf16 hidden-sized buffers per scheduled token
    step_sampler_copies: float = 2.0  # fp32 logits copies per sampled row in a real step


_FIXED = frozenset({"sampler_copies", "step_hidden", "profile_hidden"})  # shapes, not sizes


def perturbed(seed: int) -> Coefficients:
    """Seed 0: exactly the calibration; else each size perturbed (`pretuner.sim.memory`)."""
    return perturb(Coefficients(), f"pretuner-sim-v1-coefficients-{seed}", _FIXED,
                   exact=seed == DEFAULT_SEED)


def round_alloc(n_bytes: float) -> int:
    """An allocation as torch's caching allocator takes it (2 MiB granules)."""
    return int(-(-int(n_bytes) // ALLOC_ROUND) * ALLOC_ROUND)


@dataclass(frozen=True, slots=True)
class Alloc:
    """One allocation of a sequence: `live_before` bytes are held when `size` is asked."""

    what: str
    live_before: int
    size: int


@dataclass(frozen=True, slots=True)
class V1Card:
    """The memory of one rank for one model, layout and seed (all ranks are identical)."""

    spec: ModelSpec
    weights_total_bytes: int
    coeffs: Coefficients
    tp: int = 1
    kv_dtype: str = "auto"
    block_size: int = 16
    batched_tokens: int = _REF_BATCHED_TOKENS

    @property
    def scale(self) -> float:
        return self.spec.num_layers * self.spec.hidden_size / _REF_LAYERS_X_HIDDEN

    @property
    def step_scale(self) -> float:
        """Buffers sized by one layer's width and the step budget (smaller budgets hold less,
        larger ones no more), relative to the calibration's."""
        width = self.spec.hidden_size / _REF_HIDDEN / self.scale  # `_mib` multiplies by scale
        return width * min(1.0, self.batched_tokens / _REF_BATCHED_TOKENS)

    def _mib(self, value: float, scaled: bool = True) -> int:
        return int(value * (self.scale if scaled else 1.0) * MIB)

    @property
    def weights_bytes(self) -> int:
        """What "Model loading took" reports: the shard plus load-time buffers."""
        return self.weights_total_bytes // self.tp + self._mib(self.coeffs.load_extra_mib, False)

    @property
    def persistent_bytes(self) -> int:
        return self._mib(self.coeffs.persistent_mib * self.step_scale)

    @property
    def kv_cache(self) -> CacheLayout:
        """This rank's KV cache layout (`pretuner.sim.kvcache`)."""
        return cache_layout(self.spec, tp=self.tp, cache_dtype=self.kv_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_cache.bytes_per_token

    @property
    def block_bytes(self) -> int:
        return self.kv_cache.block_bytes(self.block_size)

    def kv_tokens(self, kv_bytes: int) -> int:
        """`GPU KV cache size: N tokens`: whole blocks only."""
        return max(0, kv_bytes // self.block_bytes) * self.block_size

    def profile_activation_bytes(self, batched_tokens: int) -> int:
        s = self.spec
        per_token = 3 * s.intermediate_size / self.tp + self.coeffs.profile_hidden * s.hidden_size
        return int(batched_tokens * s.dtype_bytes * per_token)

    def base_bytes(self, context_bytes: int) -> int:
        """Process memory after profiling, before the KV cache."""
        return context_bytes + self.weights_bytes + self.persistent_bytes

    # -- what happens after the KV cache is allocated -----------------------------------------
    @property
    def graph_pool_bytes(self) -> int:
        return self._mib(self.coeffs.graph_pool_mib)

    def graph_capture(self) -> Alloc:
        """The allocation that decides whether capture fits (pool + scratch held)."""
        c = self.coeffs
        held = self._mib(c.graph_private_peak_mib) + self._mib(c.graph_scratch_mib)
        return Alloc("graph", held, round_alloc(self._mib(c.graph_alloc_mib)))

    def graph_private_bytes(self) -> int:
        return round_alloc(self._mib(self.coeffs.graph_private_peak_mib))

    def sampler_logits_bytes(self, max_num_seqs: int) -> int:
        rows = self.coeffs.sampler_copies * max_num_seqs
        return round_alloc(rows * self.spec.vocab_size * 4)

    def warmup(self, max_num_seqs: int) -> list[Alloc]:
        """Kernel warm-up then the sampler's warm-up, each kept in torch's cache."""
        w = round_alloc(self._mib(self.coeffs.warmup_mib * self.step_scale))
        logits = self.sampler_logits_bytes(max_num_seqs)
        extra = round_alloc(logits * self.coeffs.sampler_extra)
        return [Alloc("warmup", 0, w), Alloc("sampler", w, logits),
                Alloc("sampler-extra", w + logits, extra)]

    def step(self, tokens: int, rows: int) -> list[Alloc]:
        """One engine step of `tokens` scheduled tokens sampling `rows` sequences."""
        s, c = self.spec, self.coeffs
        dt = s.dtype_bytes
        held = (self._mib(c.step_fixed_mib * self.step_scale)
                + int(c.step_hidden * s.hidden_size * tokens * dt)
                + int(c.step_sampler_copies * rows * s.vocab_size * 4))
        inter = s.intermediate_size // self.tp
        gate_up = round_alloc(2 * inter * tokens * dt)
        act = round_alloc(inter * tokens * dt)
        return [Alloc("step", 0, held), Alloc("gate_up", held, gate_up),
                Alloc("act", held + gate_up, act)]


def peak_of(allocs: list[Alloc]) -> int:
    """The most a sequence of allocations holds at once."""
    return max((a.live_before + a.size for a in allocs), default=0)


def first_failure(allocs: list[Alloc], reserved: int, room: int) -> Alloc | None:
    """The first allocation that does not fit: torch reuses its `reserved` cache, and may
    take `room` more bytes from the GPU."""
    for a in allocs:
        if max(reserved, a.live_before + a.size) > room:
            return a
    return None
