"""What only the emulator knows about r0.1: the largest KV cache and longest length that fit.

Pure, over `pretuner.sim.memory`. "Fits": on every rank, weights + workspace + KV + the worst
full-load step stay within the card's free memory, and the KV holds max-num-seqs max-length
sequences beside the 1 % watermark. `physical` splits the pool anywhere; `r01` only where the
integer `vLLM_MODEL_MEMORY_USE_GB` can, the ceiling an r0.1 tuner is scored against."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pretuner.sim.loop import blocks_for
from pretuner.sim.memory import (
    DEFAULT_CHUNK_TOKENS,
    CardModel,
    full_load_prefill,
)
from pretuner.sim.scheduler import watermark_blocks
from pretuner.units import GIB


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
    lo, hi = 1, max(1, seqs_supported(at(1).kv_bytes, bb, bs, max_model_len))
    while lo < hi:  # ok() is true up to some count and false above it
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return at(lo)


def max_length(models: Sequence[CardModel], free_bytes: int, *, limit: int, chunked: bool,
               integer_model_use: bool = True, granularity: int = 16) -> int:
    """The longest max_model_len (a multiple of `granularity`, at most `limit`) at which one
    sequence fits with whole-prompt steps, or with vLLM's default 2048-token chunks; 0 when
    none does."""

    def fits(length: int) -> bool:
        batched = DEFAULT_CHUNK_TOKENS if chunked else length
        return max_safe_kv(models, free_bytes, length, batched=batched, chunked=chunked,
                           integer_model_use=integer_model_use) is not None

    lo, hi = 0, limit // granularity
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * granularity) else (lo, mid - 1)
    return lo * granularity
