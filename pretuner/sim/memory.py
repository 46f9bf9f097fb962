"""The emulated Ascend card's physical memory model under r0.1: every coefficient lives here.

Pure; bytes per card (per rank) unless the name says otherwise; the numbers are *simulated*.
A card holds the driver reservation, the CANN share (outside MindSpore's pool), then the pool
capped at `max_device_memory`: weights shard, workspace, the KV cache r0.1's formula allocates,
and each step's dynamic part (activations, decode, sampler) plus fragments. `actual peak used`
includes the fragments; each rank scales its dynamic part by its own seeded factor, so the
ranks of a TP group print slightly different peaks. The hidden coefficients are perturbed by a
seeded +-`PERTURBATION` factor each, so nothing can rely on exact values."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, TypeVar

from pretuner.models.spec import ModelSpec
from pretuner.sim.kvcache import CacheLayout, cache_layout
from pretuner.units import GIB, MIB

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

Prefill = Sequence[tuple[int, int]]  # (new tokens, context tokens) per prompt chunk in a step

PERTURBATION = 0.10  # each hidden coefficient is scaled by a factor in [0.9, 1.1]
DEFAULT_SEED = 0
WARMUP_TOKENS_CAP = 8192  # r0.1 runs one dummy prefill of min(8192, max_model_len) at start
CHUNKED_PREFILL_ABOVE = 32768  # vLLM 0.6 turns chunked prefill on by default above 32K
DEFAULT_CHUNK_TOKENS = 2048  # vLLM 0.6.6's max_num_batched_tokens when chunked prefill is on


@dataclass(frozen=True, slots=True)
class CardProfile:
    """One kind of card: its size, what the driver and CANN take, and how npu-smi names it."""

    name: str
    chip_name: str
    total_mib: int
    driver_reserved_mib: int
    cann_mib: int
    cards_per_node: int = 8
    power_w: float = 97.5
    temp_c: int = 41

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MIB

    @property
    def free_bytes(self) -> int:
        """What MindSpore finds free at init: total - driver reservation - CANN share."""
        return (self.total_mib - self.driver_reserved_mib - self.cann_mib) * MIB


PROFILES: dict[str, CardProfile] = {
    p.name: p
    for p in (
        # 3379 MB used on an idle card is what npu-smi shows on a real 64 GB 910B3.
        CardProfile("910b-64", "910B3", 65536, 3379, 700),
        CardProfile("910b-32", "910B4", 32768, 2300, 500),
        # A 24 GB inference card (Atlas 300I Pro class): small cards are where every reserve
        # and rounding shows.
        CardProfile("310p-24", "310P3", 24576, 1700, 450, power_w=62.0, temp_c=38),
        # A 64 GB card where another tenant/driver build takes more: util 0.9 no longer fits.
        CardProfile("910b-64-busy", "910B3", 65536, 6750, 900, power_w=112.0, temp_c=47),
    )
}
DEFAULT_PROFILE = "910b-64"


@dataclass(frozen=True, slots=True)
class Coefficients:
    """The hidden coefficients of the model (see the module docstring for each formula)."""

    weights_overhead: float = 0.02
    # Norms, MoE routers and biases stay whole on every rank; embeddings and lm_head are split
    # by vocabulary in vLLM, so the replicated share of a large model is a fraction of a percent.
    replicated: float = 0.002
    workspace_mib: float = 640.0
    act_hidden: float = 10.0
    act_mlp: float = 3.0
    attn_quad: float = 0.05
    decode_act: float = 24.0
    sampler_copies: float = 3.0
    frag: float = 0.06
    frag_per_seq_mib: float = 4.0
    rank_jitter: float = 0.015  # per-rank spread of the dynamic part (+-)


def perturb(base: T, key: str, fixed: frozenset[str] = frozenset(), exact: bool = False) -> T:
    """`base` (`exact`: as it is) with each field but `fixed` scaled within +-PERTURBATION by a
    generator seeded with `key`: both personalities' hidden coefficients."""
    if exact:
        return base
    rng = random.Random(key)  # noqa: S311 - not crypto
    changes = {f.name: getattr(base, f.name) * (1 + rng.uniform(-PERTURBATION, PERTURBATION))
               for f in fields(base) if f.name not in fixed}
    return replace(base, **changes)


def perturbed(seed: int) -> Coefficients:
    """r0.1's coefficients: perturbed for every seed, 0 included."""
    return perturb(Coefficients(), f"pretuner-sim-coefficients-{seed}")


@dataclass(frozen=True, slots=True)
class Layout:
    """The parallel layout and the knobs of the r0.1 KV formula."""

    tp: int = 1
    pp: int = 1
    block_size: int = 16
    kv_dtype: str = "auto"

    @property
    def world(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True, slots=True)
class CardModel:
    """The memory of one rank's card for one model, layout and seed."""

    spec: ModelSpec
    weights_total_bytes: int
    layout: Layout
    coeffs: Coefficients
    rank_factor: float = 1.0
    noise_bytes: int = 0  # this boot's extra workspace (PRETUNER_SIM_BOOT_NOISE_MIB)

    @property
    def weights_bytes(self) -> int:
        c, lay = self.coeffs, self.layout
        sharded = self.weights_total_bytes * (1 - c.replicated) / (lay.tp * lay.pp)
        replicated = self.weights_total_bytes * c.replicated / lay.pp
        return int((sharded + replicated) * (1 + c.weights_overhead))

    @property
    def workspace_bytes(self) -> int:
        return int(self.coeffs.workspace_mib * MIB) + self.noise_bytes

    @property
    def kv_cache(self) -> CacheLayout:
        """This rank's KV cache layout (the busiest stage's; `pretuner.sim.kvcache`)."""
        lay = self.layout
        return cache_layout(self.spec, tp=lay.tp, pp=lay.pp, cache_dtype=lay.kv_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_cache.bytes_per_token

    @property
    def block_bytes(self) -> int:
        return self.kv_cache.block_bytes(self.layout.block_size)

    def activation_bytes(self, prefill: Prefill) -> int:
        """Activation peak of one step prefilling (new tokens, context) chunks."""
        if not prefill:
            return 0
        s, c, tp = self.spec, self.coeffs, self.layout.tp
        tokens = sum(n for n, _ in prefill)
        linear = tokens * s.dtype_bytes * (c.act_hidden * s.hidden_size
                                           + c.act_mlp * s.intermediate_size / tp)
        heads_local = max(1, s.num_heads // tp)
        quad = c.attn_quad * heads_local * sum(n * ctx for n, ctx in prefill)
        return int((linear + quad) * self.rank_factor)

    def decode_bytes(self, running: int) -> int:
        s = self.spec
        return int(self.coeffs.decode_act * running * s.hidden_size * s.dtype_bytes
                   * self.rank_factor)

    def sampler_bytes(self, running: int) -> int:
        return int(self.coeffs.sampler_copies * running * self.spec.vocab_size * 4)

    def dynamic_bytes(self, prefill: Prefill, running: int) -> int:
        """One step's transient memory, fragments included (what the pool must find)."""
        base = self.dynamic_bytes_no_frag(prefill, running)
        return int(base * (1 + self.coeffs.frag) + self.coeffs.frag_per_seq_mib * MIB * running)

    def dynamic_bytes_no_frag(self, prefill: Prefill, running: int) -> int:
        return (self.activation_bytes(prefill) + self.decode_bytes(running)
                + self.sampler_bytes(running))

    @property
    def static_bytes(self) -> int:
        """Weights + workspace: held from load to exit."""
        return self.weights_bytes + self.workspace_bytes


def card_models(spec: ModelSpec, weights_total_bytes: int, layout: Layout, seed: int,
                rank_skew: dict[int, float] | None = None) -> list[CardModel]:
    """One memory model per rank, each with its seeded (and optionally skewed) factor on the
    dynamic part: ranks differ slightly, reproducibly."""
    coeffs = perturbed(seed)
    jitter, skew = coeffs.rank_jitter, rank_skew or {}
    rng = random.Random(f"pretuner-sim-ranks-{seed}")  # noqa: S311 - not crypto
    return [CardModel(spec, weights_total_bytes, layout, coeffs,
                      (1 + rng.uniform(-jitter, jitter)) * skew.get(i, 1.0))
            for i in range(layout.world)]


def pool_cap_bytes(total_gb: int, util: float) -> int:
    """`max_device_memory` = TOTAL * util GiB, as r0.1 passes it to MindSpore."""
    return int(total_gb * util * GIB)


def r01_kv_blocks(total_gb: int, util: float, model_use_gb: int, block_bytes: int) -> int:
    """r0.1's `calc_block_num`: may be negative (the engine then refuses to start)."""
    return math.floor((total_gb * GIB * util - model_use_gb * GIB) / block_bytes)


def whole(lens: Sequence[int]) -> list[tuple[int, int]]:
    """Whole prompts as prefill chunks."""
    return [(n, n) for n in lens]


def full_load_prefill(
    max_model_len: int, max_num_seqs: int, batched: int, chunked: bool = False
) -> list[tuple[int, int]]:
    """The worst prefill step under full load: as many max-length prompts as the budget
    admits, or, chunked, one budget-sized chunk at the end of a max-length prompt."""
    longest = max(1, max_model_len - 1)
    if chunked:
        return [(max(1, min(batched, longest)), longest)]
    longest = max(1, min(longest, batched))
    return whole([longest] * max(1, min(max_num_seqs, batched // longest)))
