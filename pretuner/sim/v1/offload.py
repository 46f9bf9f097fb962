"""The emulated card's weights as loaded (quantized, offloaded), its host, and its clock.

Pure; every figure *simulated*. `--quantization` quantizes a 16-bit checkpoint as it loads
(awq/gptq without a quantization_config are refused, fp8 needs capability 8.0);
`--cpu-offload-gb` keeps decoder weights in pinned host memory, read over PCIe every step; a
server that takes more host memory than is available is killed by the OOM killer while it
loads; a step's time is weights read + offload streamed + FLOPs + eager launch costs, slept
times `PRETUNER_SIM_TIME_SCALE`."""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.models.quant import Quantization, from_flag, quantized_bytes
from pretuner.models.spec import ModelSpec
from pretuner.sim.argv import Refused
from pretuner.sim.v1.memory import CUDA_PROFILES, CudaProfile
from pretuner.units import GIB, MIB

HOST_ENV = "PRETUNER_SIM_HOST_MIB"
PROCESS_HOST_MIB = 5 * 1024  # API server + EngineCore + torch + tokenizer, resident on the host
HOST_SYSTEM_SHARE = 0.03  # what the system and page cache keep of the host's memory
SWAP_REFUSE_SHARE = 0.7  # vLLM refuses --swap-space x TP above this share of the host total
SWAP_WARN_SHARE = 0.4
IN_FLIGHT = ("bitsandbytes", "fp8")  # what vLLM quantizes while loading a 16-bit checkpoint
BNB_DEQUANT = 3.0  # bitsandbytes 4-bit kernels: dequantizing costs 3x reading the bytes
STEP_OVERHEAD_S = 0.004  # scheduler, sampler, launches with CUDA graphs
EAGER_LAYER_S = 0.00008  # kernel launches per decoder layer without CUDA graphs


@dataclass(frozen=True, slots=True)
class Loaded:
    """One rank's weights as loaded, and what the host holds for it."""

    quant: Quantization | None
    total_bytes: int  # the whole model as loaded (all ranks)
    rank_bytes: int  # one rank's share before offload
    offloaded_bytes: int  # of that share, kept in pinned host memory

    @property
    def on_card_bytes(self) -> int:
        return self.rank_bytes - self.offloaded_bytes


def _quantization(spec: ModelSpec, method: str | None, capability: int) -> Quantization | None:
    stored = spec.quantization
    if method is None:
        return stored
    name = method.lower()
    if stored is not None:
        if stored.method != name:
            raise Refused("ValueError", f"Quantization method specified in the model config "
                          f"({stored.method}) does not match the quantization method "
                          f"specified in the `quantization` argument ({name}).")
        return stored
    if name not in IN_FLIGHT:
        raise Refused("ValueError", f"Cannot find the config file for {name}: the checkpoint "
                      "has no quantization_config (only bitsandbytes and fp8 quantize a "
                      "16-bit checkpoint while loading)")
    if name == "fp8" and capability < 80:
        raise Refused("ValueError", f"The quantization method fp8 is not supported for the "
                      f"current GPU. Minimum capability: 80. Current capability: "
                      f"{capability}.")
    return from_flag(name)


def load(spec: ModelSpec, profile: str, tp: int, quantization: str | None,
         offload_gib: float) -> Loaded:
    """The weights as this server loads them; Refused for a quantization vLLM refuses."""
    quant = _quantization(spec, quantization, CUDA_PROFILES[profile].capability)
    native = spec.weights_format().total_bytes
    total = native if quant is None or spec.quantization is not None else quantized_bytes(
        spec, quant)
    rank = total // tp
    embeddings = 2 * spec.vocab_size * spec.hidden_size * spec.dtype_bytes
    layers_share = max(0, total - embeddings) // tp
    offloaded = min(layers_share, int(offload_gib * GIB))
    return Loaded(quant, total, rank, offloaded)


def host_total_bytes(profile: str, host_mib: int | None) -> int:
    return (host_mib if host_mib is not None else CUDA_PROFILES[profile].host_mib) * MIB


def host_available_bytes(profile: str, host_mib: int | None) -> int:
    """What a new process may take of the emulated host (the system keeps its share)."""
    total = host_total_bytes(profile, host_mib)
    return int(total * (1 - HOST_SYSTEM_SHARE))


def swap_warning(swap_gib: float, tp: int, host_total: int) -> str | None:
    """vLLM's start-up check of --swap-space against the host: its warning, or Refused."""
    used = swap_gib * GIB * tp
    msg = (f"{used / GIB:.2f} GiB out of the {host_total / GIB:.2f} GiB total CPU memory is "
           "allocated for the swap space.")
    if used > SWAP_REFUSE_SHARE * host_total:
        raise Refused("ValueError", "Too large swap space. " + msg)
    return "Possibly too large swap space. " + msg if used > SWAP_WARN_SHARE * host_total else None


@dataclass(frozen=True, slots=True)
class Clock:
    """Seconds one engine step takes on the emulated card (simulated)."""

    card: CudaProfile
    on_card_bytes: int
    offloaded_bytes: int
    flops_per_token: float
    layers: int
    eager: bool
    dequant_bytes: int  # 4-bit bitsandbytes weights a step dequantizes (0: none)

    def step_seconds(self, tokens: int) -> float:
        s = self.card
        read = (self.on_card_bytes + BNB_DEQUANT * self.dequant_bytes) / (s.hbm_gib_s * GIB)
        stream = self.offloaded_bytes / (s.pcie_gib_s * GIB)
        compute = self.flops_per_token * tokens / (s.tflops * 1e12)
        eager = self.layers * EAGER_LAYER_S if self.eager else 0.0
        return STEP_OVERHEAD_S + read + stream + compute + eager


def clock(spec: ModelSpec, profile: str, loaded: Loaded, tp: int, eager: bool) -> Clock:
    active = spec.active_params or spec.total_params
    q = loaded.quant
    bnb = q is not None and q.method == "bitsandbytes" and q.bits == 4
    embeddings = 2 * spec.vocab_size * spec.hidden_size * spec.dtype_bytes // tp
    return Clock(CUDA_PROFILES[profile], loaded.on_card_bytes, loaded.offloaded_bytes,
                 2.0 * active / tp, spec.num_layers, eager,
                 max(0, loaded.rank_bytes - embeddings) if bnb else 0)
