"""What only the emulator knows about r0.1: the largest KV cache and longest length that fit,
and the truth file (`--sim-truth`) a benchmark scores against.

Pure, over `pretuner.sim.memory`. "Fits": on every rank, weights + workspace + KV + the worst
full-load step stay within the card's free memory, and the KV holds max-num-seqs max-length
sequences beside the 1 % watermark. `physical` splits the pool anywhere; `r01` only where the
integer `vLLM_MODEL_MEMORY_USE_GB` can, the ceiling an r0.1 tuner is scored against."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pretuner.sim.loop import blocks_for
from pretuner.sim.memory import (
    DEFAULT_CHUNK_TOKENS,
    CardModel,
    CardProfile,
    full_load_prefill,
    pool_cap_bytes,
)
from pretuner.sim.scheduler import watermark_blocks
from pretuner.units import GIB, MIB


@dataclass(frozen=True, slots=True)
class Fit:
    """The largest KV cache that serves `max_num_seqs` sequences of `max_model_len` safely."""

    max_model_len: int
    max_num_batched_tokens: int
    chunked: bool
    max_num_seqs: int
    kv_bytes: int
    non_kv_peak_bytes: int  # worst rank, full load with max_num_seqs sequences
    model_use_gib: int | None  # the r0.1 integer that gives this KV (None: physical split)


def non_kv_peak(models: Sequence[CardModel], max_model_len: int, seqs: int, batched: int,
                chunked: bool) -> int:
    """Worst rank's weights + workspace + the worst full-load step, fragments included."""
    step = full_load_prefill(max_model_len, seqs, batched, chunked)
    return max(m.static_bytes + m.dynamic_bytes(step, seqs) for m in models)


def seqs_supported(kv_bytes: int, block_bytes: int, block_size: int, max_model_len: int) -> int:
    """Max-length sequences a KV cache holds concurrently beside the 1 % watermark."""
    blocks = max(0, kv_bytes // block_bytes)
    usable = blocks - watermark_blocks(blocks)
    return max(0, usable // blocks_for(max_model_len, block_size))


def max_safe_kv(models: Sequence[CardModel], free_bytes: int, max_model_len: int, *,
                batched: int, chunked: bool, integer_model_use: bool = True) -> Fit | None:
    """The largest KV (and its max-num-seqs) that fits, or None when one sequence does not."""
    first = models[0]
    bb, bs = first.block_bytes, first.layout.block_size

    def at(seqs: int) -> Fit:
        peak = non_kv_peak(models, max_model_len, seqs, batched, chunked)
        room = math.ceil(peak / GIB) * GIB if integer_model_use else peak
        kv = max(0, (free_bytes - 1 - room) // bb * bb)
        return Fit(max_model_len, batched, chunked, seqs, kv, peak,
                   room // GIB if integer_model_use else None)

    def ok(seqs: int) -> bool:
        return seqs_supported(at(seqs).kv_bytes, bb, bs, max_model_len) >= seqs

    if not ok(1):
        return None
    hi = seqs_supported(at(1).kv_bytes, bb, bs, max_model_len)
    # ok() is true up to some count and false above it
    return at(1 + bisect.bisect_left(range(2, hi + 1), True, key=lambda s: not ok(s)))


def max_length(models: Sequence[CardModel], free_bytes: int, *, limit: int, chunked: bool,
               integer_model_use: bool = True, granularity: int = 16) -> int:
    """The longest max_model_len (a multiple of `granularity`, at most `limit`) at which one
    sequence fits with whole-prompt steps, or with vLLM's default 2048-token chunks; 0 when
    none does."""

    def fits(length: int) -> bool:
        batched = DEFAULT_CHUNK_TOKENS if chunked else length
        return max_safe_kv(models, free_bytes, length, batched=batched, chunked=chunked,
                           integer_model_use=integer_model_use) is not None

    steps = range(1, limit // granularity + 1)
    return granularity * bisect.bisect_left(steps, True, key=lambda m: not fits(m * granularity))


def truth(models: Sequence[CardModel], profile: CardProfile, *, seed: int, total_gb: int,
          util: float, kv_blocks: int, max_model_len: int, max_num_seqs: int, batched: int,
          chunked: bool, occupied_mib: int = 0) -> dict[str, Any]:
    """The truth file's content. The safe KV figures are the card's free memory, or the pool
    cap, less the worst full-load peak; `max_safe_kv_*` as `max_safe_kv` finds them."""
    lens = full_load_prefill(max_model_len, max_num_seqs, batched, chunked)
    per_rank = [m.static_bytes + m.dynamic_bytes(lens, max_num_seqs) for m in models]
    worst = max(per_rank)
    first = models[0]
    cap = pool_cap_bytes(total_gb, util)
    doc = {
        "profile": profile.name,
        "seed": seed,
        "card_total_bytes": profile.total_bytes,
        "card_free_bytes": profile.free_bytes,
        "pool_cap_bytes": cap,
        "weights_bytes_per_card": first.weights_bytes,
        "workspace_bytes": first.workspace_bytes,
        "kv_bytes_per_token": first.kv_bytes_per_token,
        "activation_peak_bytes_at_batched_budget": max(m.activation_bytes(lens) for m in models),
        "non_kv_peak_bytes_full_load": worst,
        "non_kv_peak_bytes_per_rank": per_rank,
        "safe_kv_bytes_full_load": profile.free_bytes - worst,
        "safe_kv_bytes_in_pool": cap - worst,
        "kv_bytes_allocated": max(0, kv_blocks) * first.block_bytes,
        "coefficients": asdict(first.coeffs),
    }
    free = profile.free_bytes - occupied_mib * MIB
    for name, integer in (("r01", True), ("physical", False)):
        fit = max_safe_kv(models, free, max_model_len, batched=batched, chunked=chunked,
                          integer_model_use=integer)
        doc[f"max_safe_kv_{name}"] = asdict(fit) if fit else None
    return {**doc, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": batched, "kv_blocks": kv_blocks}
