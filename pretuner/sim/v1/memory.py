"""The emulated CUDA card's memory under vLLM 0.24 (V1 engine): every coefficient lives here.

Pure. Bytes per rank unless the name says MiB; the numbers are *simulated*, calibrated so that
seed 0 on `h100-80` replays the real Qwen3-8B and -30B-A3B runs under
../shared/real-logs/vllm-0.24-h100/ at the max-num-seqs they ran with, vLLM's 1024 (outcome, KV
figures and NVML peaks). NVML counts the driver's idle reservation, other tenants,
then this process: CUDA context, weights, persistent buffers, KV cache, CUDA-graph pool and
torch's cached transients (kept reserved, so NVML only grows). Profiling (util mode) sees only
a dummy step of max_num_batched_tokens: not graph capture, warm-up, the sampler's logits nor a
real step's workspace. That gap is why util 0.98 passes profiling and dies in graph capture.

An MoE model (the real Qwen3-30B-A3B run G1) starts on vLLM's V1 GPU model runner instead (the
V2 runner the dense runs report has no fused MoE): its profile run also samples max_num_seqs
dummy rows with top-k/top-p (a sort of the whole vocabulary), and the CUDA-graph estimate it
logs is taken from the KV budget. Its warm-up after the KV cache samples the same way."""

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
    """One kind of GPU as NVML and torch see it, and how fast it runs: one row per card."""

    name: str  # PRETUNER_SIM_PROFILE
    gpu_name: str  # what NVML and nvidia-smi call it
    model: str  # what the output calls it: "emulated H200 141 GB"
    card_gb: int  # the --card that picks it (the first row of a size is that size's default)
    nvml_total_mib: int  # NVML's memory.total, as nvidia-smi prints it on the real card
    idle_mib: int  # NVML used on an idle GPU (driver reservation)
    context_mib: int  # a CUDA context of a vLLM worker
    hbm_gib_s: float  # weights read per step from the card's memory
    pcie_gib_s: float  # pinned host memory to the card
    tflops: float  # dense 16-bit FLOPs achieved by a prefill
    capability: int  # CUDA compute capability x 10
    host_mib: int  # the emulated host's memory (default of PRETUNER_SIM_HOST_MIB)
    power_w: int
    power_cap_w: int
    gpus_per_node: int = 8

    @property
    def torch_total_bytes(self) -> int:
        """torch's "total capacity": what NVML reports minus the idle reservation."""
        return (self.nvml_total_mib - self.idle_mib) * MIB


TIB_MIB = 1024 * 1024
# Totals are NVML's (nvidia-smi's "MiB / TOTALMiB" on the real card, source beside each row);
# idle, context, power and speeds are simulated, except where a row says measured.
CUDA_PROFILES: dict[str, CudaProfile] = {
    p.name: p
    for p in (
        # Calibrated on the real H100 80GB HBM3 logs: 81559 MiB total, 480 MiB idle,
        # "Initial free memory 78.66 GiB" (the context takes ~532 MiB).
        CudaProfile("h100-80", "NVIDIA H100 80GB HBM3", "H100", 80, 81559, 480, 532,
                    3000.0, 50.0, 600.0, 90, TIB_MIB, 69, 700),
        # tests/fixtures/real/vllm-0.24-h200: 143771 MiB, 615 MiB idle, the first context
        # step to 1211 MiB (measured).
        CudaProfile("h200-141", "NVIDIA H200", "H200", 141, 143771, 615, 596,
                    4000.0, 50.0, 650.0, 90, 2 * TIB_MIB, 76, 700),
        # github.com/allenai/PeerRead/issues/40: "0MiB / 81920MiB".
        CudaProfile("a100-80", "NVIDIA A100-SXM4-80GB", "A100", 80, 81920, 420, 500,
                    1700.0, 24.0, 250.0, 80, TIB_MIB, 61, 400),
        # 40960 MiB, as nvidia-smi shows an A100-SXM4-40GB in published output (not verified
        # against a log: CUDA's 40,339 MiB in github.com/bottlerocket-os/bottlerocket/pull/3873).
        CudaProfile("a100-40", "NVIDIA A100-SXM4-40GB", "A100", 40, 40960, 420, 500,
                    1300.0, 24.0, 250.0, 80, 512 * 1024, 55, 400),
        # github.com/akash-network/provider-configs/pull/99: "NVIDIA L40S, ..., 46068 MiB".
        CudaProfile("l40s-48", "NVIDIA L40S", "L40S", 48, 46068, 380, 450,
                    750.0, 24.0, 300.0, 89, 512 * 1024, 36, 350),
        # github.com/NVIDIA/gpu-admin-tools/issues/4: "0MiB / 95830MiB".
        CudaProfile("h100-nvl-94", "NVIDIA H100 NVL", "H100 NVL", 94, 95830, 520, 532,
                    3300.0, 50.0, 700.0, 90, TIB_MIB, 69, 400),
        # github.com/NVIDIA/nvtrust/issues/128: "0MiB /  97871MiB".
        CudaProfile("h20-96", "NVIDIA H20", "H20", 96, 97871, 530, 532,
                    3400.0, 50.0, 140.0, 90, TIB_MIB, 74, 500),
        # github.com/NVIDIA/TensorRT-LLM/issues/10278: "166593MiB / 183359MiB".
        CudaProfile("b200-180", "NVIDIA B200", "B200", 180, 183359, 720, 600,
                    6500.0, 55.0, 1800.0, 100, 2 * TIB_MIB, 140, 1000),
        # Plausible smaller cards with the same structure (simulated, never measured).
        CudaProfile("cuda-24", "NVIDIA L4", "L4", 24, 23034, 290, 420,
                    280.0, 24.0, 110.0, 89, 64 * 1024, 16, 72),
        CudaProfile("cuda-32", "Tesla V100-SXM2-32GB", "V100", 32, 32768, 310, 450,
                    840.0, 12.0, 100.0, 70, 128 * 1024, 42, 300),
        CudaProfile("cuda-64", "NVIDIA A100-SXM4-64GB", "A100", 64, 65536, 420, 500,
                    1500.0, 24.0, 250.0, 80, 256 * 1024, 58, 400),
        # The field note's 20 GB card (its nvidia-smi: 20480MiB, 26W / 320W idle).
        CudaProfile("cuda-20", "NVIDIA GeForce RTX 3080", "RTX 3080", 20, 20480, 260, 400,
                    700.0, 24.0, 100.0, 86, 64 * 1024, 26, 320),
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
    sampler_copies: float = 1.0  # fp32 logits rows per sequence (1024 x vocab x 4 B on H100)
    sampler_extra: float = 0.52  # softmax/sort temporaries, as a share of those logits
    step_fixed_mib: float = 1030.0  # per-step workspace a real step holds, profiling does not
    step_hidden: float = 2.0  # bf16 hidden-sized buffers per scheduled token
    # fp32 logits copies per sampled row in a real step, held after the layers' transients
    # are freed: the real H200's 1024-wide burst in its worse boot (+476 MiB over the proof
    # load; tests/fixtures/real/vllm-0.24-h200-burst)
    step_sampler_copies: float = 1.8
    # Bytes per row and vocabulary entry of the V1 runner's profiled sampler: the bf16 logits,
    # their fp32 copy, the sort's fp32 values and int64 indices (top-k/top-p sorts them all).
    sort_bytes: float = 18.0
    graph_estimate_share: float = 0.8  # the V1 runner's estimate / the pool (G1: 0.64 / 0.80)
    moe_graph_factor: float = 1.18  # an MoE layer's graphs hold more than a dense one's (G1)


_FIXED = frozenset({"sampler_copies", "step_hidden", "profile_hidden", "sort_bytes",
                    "graph_estimate_share"})  # shapes, not sizes


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

    @property
    def moe(self) -> bool:
        """Routed experts: the V1 runner and the fused-MoE kernel (module docstring)."""
        return self.spec.num_experts_per_tok > 0

    def mlp_bytes(self, tokens: int) -> tuple[int, int]:
        """The MLP's two transients for `tokens` tokens: gate/up and the activation; for an
        MoE, the fused-MoE kernel's workspaces: (tokens, top_k, max(2 I, H)) holds gate/up and
        then the experts' outputs, (tokens, top_k, I) the activation."""
        s, dt = self.spec, self.spec.dtype_bytes
        if not self.moe:
            inter = s.intermediate_size // self.tp
            return 2 * inter * tokens * dt, inter * tokens * dt
        inter = (s.moe_intermediate_size or s.intermediate_size) // self.tp
        rows = tokens * s.num_experts_per_tok
        return rows * max(2 * inter, s.hidden_size) * dt, rows * inter * dt

    def profile_activation_bytes(self, batched_tokens: int, max_num_seqs: int) -> int:
        """The profile run's peak above the weights: the dummy step's, or the V1 runner's
        sampler over max_num_seqs rows where that is larger."""
        s, c = self.spec, self.coeffs
        if not self.moe:
            per_token = 3 * s.intermediate_size / self.tp + c.profile_hidden * s.hidden_size
            return int(batched_tokens * s.dtype_bytes * per_token)
        forward = int(batched_tokens * s.dtype_bytes * c.profile_hidden * s.hidden_size)
        forward += sum(self.mlp_bytes(batched_tokens))
        return max(forward, self.sort_bytes(max_num_seqs))

    def sort_bytes(self, rows: int) -> int:
        """The V1 runner's top-k/top-p sampler over `rows` rows of logits."""
        return round_alloc(rows * self.spec.vocab_size * self.coeffs.sort_bytes)

    def base_bytes(self, context_bytes: int) -> int:
        """Process memory after profiling, before the KV cache."""
        return context_bytes + self.weights_bytes + self.persistent_bytes

    # -- what happens after the KV cache is allocated -----------------------------------------
    @property
    def graph_pool_bytes(self) -> int:
        c = self.coeffs
        return self._mib(c.graph_pool_mib * (c.moe_graph_factor if self.moe else 1.0))

    @property
    def graph_estimate_bytes(self) -> int:
        """What the V1 runner's `Estimated CUDA graph memory` takes from the KV budget."""
        return int(self.graph_pool_bytes * self.coeffs.graph_estimate_share) if self.moe else 0

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
        if self.moe:
            return [Alloc("warmup", 0, w), Alloc("sampler", w, self.sort_bytes(max_num_seqs))]
        logits = self.sampler_logits_bytes(max_num_seqs)
        extra = round_alloc(logits * self.coeffs.sampler_extra)
        return [Alloc("warmup", 0, w), Alloc("sampler", w, logits),
                Alloc("sampler-extra", w + logits, extra)]

    def step(self, tokens: int, rows: int) -> list[Alloc]:
        """One engine step of `tokens` scheduled tokens sampling `rows` sequences."""
        s, c = self.spec, self.coeffs
        dt = s.dtype_bytes
        held = (self._mib(c.step_fixed_mib * self.step_scale)
                + int(c.step_hidden * s.hidden_size * tokens * dt))
        gate_up, act = (round_alloc(n) for n in self.mlp_bytes(tokens))
        # The sampler runs on the last hidden states, after the layers' transients are freed.
        sampler = round_alloc(c.step_sampler_copies * rows * s.vocab_size * 4)
        return [Alloc("step", 0, held), Alloc("gate_up", held, gate_up),
                Alloc("act", held + gate_up, act), Alloc("sampler", held, sampler)]


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
