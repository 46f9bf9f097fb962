"""KV-cache bytes per token per card and the token count a KV byte budget buys, as vLLM does it.

Pure functions: no I/O. See docs/method.md.
"""

from __future__ import annotations

import math

from pretuner.errors import BadInputError
from pretuner.models.spec import DTYPE_BYTES, AttentionKind, ModelSpec

# vLLM's fp8 variants keep their names: the server gets what the user chose (1 byte each).
KV_DTYPES = ("auto", "bf16", "fp16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int8-mla")

# MindSpore's int8 MLA cache keeps the 512-wide latent in int8 and the 64-wide rope part in
# bf16: 512 * 1 + 64 * 2 = 640 bytes per layer for DeepSeek-V3/R1.
_MLA_ROPE_BYTES_INT8_LAYOUT = 2


def layers_per_stage(num_layers: int, pp: int) -> int:
    """Layers on the busiest pipeline stage (the worst stage decides the KV budget)."""
    if pp < 1:
        raise BadInputError(f"pipeline parallel size {pp} is invalid", hint="use --pp 1 or more")
    if pp > num_layers:
        raise BadInputError(
            f"pipeline parallel size {pp} exceeds the model's {num_layers} layers",
            hint=f"use --pp {num_layers} or less",
        )
    return math.ceil(num_layers / pp)


def kv_heads_per_card(spec: ModelSpec, tp: int) -> int:
    """KV heads each tensor-parallel rank stores; replicated when kv_heads < tp."""
    if tp < 1:
        raise BadInputError(f"tensor parallel size {tp} is invalid", hint="use --tp 1 or more")
    if spec.num_heads % tp:
        raise BadInputError(
            f"{spec.name} has {spec.num_heads} attention heads, not divisible by --tp {tp}",
            hint=f"choose a --tp that divides {spec.num_heads}",
        )
    if spec.attention is AttentionKind.MLA:
        return 1  # the latent cache is not split across ranks
    kv = spec.num_kv_heads
    if kv >= tp:
        if kv % tp:
            raise BadInputError(
                f"{spec.name} has {kv} KV heads, not divisible by --tp {tp}",
                hint=f"choose a --tp that divides {kv}",
            )
        return kv // tp
    if tp % kv:
        raise BadInputError(
            f"{spec.name} has {kv} KV heads; --tp {tp} must be a multiple of it to replicate them",
            hint=f"choose a --tp that is a multiple of {kv}",
        )
    return 1


def kv_dtype_bytes(spec: ModelSpec, kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPES:
        raise BadInputError(
            f"unknown KV cache dtype {kv_dtype!r}", hint=f"choose one of: {', '.join(KV_DTYPES)}"
        )
    if kv_dtype == "auto":
        return spec.dtype_bytes
    if kv_dtype == "int8-mla":
        return 1
    return DTYPE_BYTES[kv_dtype]


def kv_bytes_per_token(spec: ModelSpec, *, tp: int = 1, pp: int = 1, kv_dtype: str = "auto") -> int:
    """KV bytes one token occupies on one card (worst pipeline stage), as vLLM sizes blocks.
    Sliding-window layers count as full layers: vLLM-MindSpore r0.1 allocates them in full."""
    layers = layers_per_stage(spec.num_layers, pp)
    local_heads = kv_heads_per_card(spec, tp)
    elem = kv_dtype_bytes(spec, kv_dtype)
    if spec.attention is AttentionKind.MLA:
        if spec.kv_lora_rank is None or spec.qk_rope_head_dim is None:
            raise BadInputError(f"{spec.name} is MLA but lacks kv_lora_rank/qk_rope_head_dim")
        if kv_dtype == "int8-mla":
            per_layer = spec.kv_lora_rank + spec.qk_rope_head_dim * _MLA_ROPE_BYTES_INT8_LAYOUT
        else:
            per_layer = (spec.kv_lora_rank + spec.qk_rope_head_dim) * elem
        return layers * per_layer
    if kv_dtype == "int8-mla":
        raise BadInputError(
            f"--kv-cache-dtype int8-mla applies to MLA models only; {spec.name} is "
            f"{spec.attention.value}",
            hint="use int8 or fp8",
        )
    return layers * 2 * local_heads * spec.head_dim * elem


def num_kv_blocks(kv_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Whole blocks that fit in `kv_bytes`; never negative (r0.1 clamps with max(0, ...))."""
    if block_size < 1:
        raise BadInputError(f"block size {block_size} is invalid", hint="use 16, 32 or 128")
    if bytes_per_token < 1:
        raise BadInputError(f"KV bytes per token {bytes_per_token} is invalid")
    return max(0, kv_bytes // (block_size * bytes_per_token))


def kv_tokens(kv_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """The `GPU KV cache size: N tokens` vLLM would print for this byte budget."""
    return num_kv_blocks(kv_bytes, bytes_per_token, block_size) * block_size


def kv_bytes_for_tokens(tokens: int, bytes_per_token: int, block_size: int) -> int:
    """Bytes needed to hold `tokens` tokens, rounded up to whole blocks."""
    blocks = -(-tokens // block_size)
    return blocks * block_size * bytes_per_token


def max_concurrency(kv_tokens_total: int, max_model_len: int) -> float:
    """vLLM's `Maximum concurrency for L tokens per request: X.XXx`."""
    return kv_tokens_total / max_model_len
