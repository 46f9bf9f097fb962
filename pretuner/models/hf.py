"""A ModelSpec from a local Hugging Face model folder, sized without loading any weights.

Only `config.json`, the checkpoint index and the safetensors *headers* are read
(`pretuner.models.checkpoint`): a 700 GB checkpoint is sized from a few megabytes of headers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pretuner.errors import BadInputError
from pretuner.models.checkpoint import (
    BYTES_PER_PARAM,
    broken,
    checkpoint_size,
    config_int,
    load_json,
    named_hub_id,
)
from pretuner.models.quant import from_config as quantization_from_config
from pretuner.models.spec import DTYPE_BYTES, SHORT_DTYPE, AttentionKind, ModelSpec, WeightsFormat
from pretuner.models.vision import vision_from_config

log = logging.getLogger(__name__)

# Each size far beyond any published model (under 200 layers, 128 heads, 26k hidden, 262k
# vocabulary, 512 experts, 2 T parameters): a larger one is a broken config.json, and plan's
# layout and offload searches step through it (10^12 layers or heads never returned).
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer")
_HIDDEN = ("hidden_size", "d_model", "n_embd")
_HEADS = ("num_attention_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "multi_query_group_num")
_INTERMEDIATE = ("intermediate_size", "ffn_hidden_size", "n_inner", "moe_intermediate_size")
_VOCAB = ("vocab_size", "padded_vocab_size")
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")
_MOST = {
    **dict.fromkeys(_LAYERS, 4096), **dict.fromkeys(_HIDDEN, 1 << 18),
    **dict.fromkeys(_HEADS + _KV_HEADS + ("head_dim",), 1 << 12),
    **dict.fromkeys(_INTERMEDIATE + ("shared_expert_intermediate_size",), 1 << 20),
    **dict.fromkeys(_VOCAB, 1 << 24), **dict.fromkeys(_EXPERTS, 1 << 14),
}
MAX_PARAMS = 10**13

def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: VL models nest it under `text_config` (or similar)."""
    for key in ("text_config", "llm_config", "language_config"):
        nested = cfg.get(key)
        if isinstance(nested, dict):
            outer = {k: v for k, v in cfg.items() if not isinstance(v, dict)}
            return {**outer, **nested}
    return cfg


@dataclass(frozen=True, slots=True)
class _Reader:
    """Typed access to config keys, with errors that name the file and the key."""

    cfg: dict[str, Any]
    origin: Path

    def opt_int(self, *keys: str) -> int | None:
        value = config_int(self.cfg, self.origin, *keys)
        key = next((k for k in keys if self.cfg.get(k) is not None), "")
        if value is not None and value > _MOST.get(key, value):
            raise broken(f"{self.origin}: {key} {value:,} is beyond any model "
                         f"(at most {_MOST[key]:,})")
        return value

    def req_int(self, *keys: str) -> int:
        """A size the model cannot be without: given, and above 0."""
        value = self.opt_int(*keys)
        if value is None:
            raise BadInputError(
                f"{self.origin} lacks {' / '.join(keys)}",
                hint="is this a decoder LLM's config.json? pass a supported model folder",
            )
        if value == 0:
            key = next(k for k in keys if self.cfg.get(k) is not None)
            raise broken(f"{self.origin}: {key} is 0; a model's sizes are above 0")
        return value


def _dtype(cfg: dict[str, Any]) -> tuple[str, str]:
    """The model's compute dtype and a note when it had to be assumed."""
    raw = cfg.get("torch_dtype") or cfg.get("dtype")
    if isinstance(raw, str):
        name = raw.removeprefix("torch.")
        if name in ("bfloat16", "float16", "float32"):
            return name, ""
    if raw is None:
        return "bfloat16", "config names no torch_dtype; bfloat16 assumed."
    return "bfloat16", f"config dtype {raw!r} not a compute dtype; bfloat16 assumed."


def _weights_format_name(folder: Path, cfg: dict[str, Any], dtype: str) -> tuple[str, int]:
    """The checkpoint's format name (bf16, fp8, mxfp4, w8a8, gptq...) and its weight bits."""
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "quantized")).lower()
        bits = quant.get("bits")
        bits = bits if isinstance(bits, int) and 0 < bits <= 32 else 4
        return method, bits
    # Ascend msModelSlim writes its scheme to a side file instead of config.json.
    for desc in sorted(folder.glob("quant_model_description*.json")):
        kind = load_json(desc).get("model_quant_type")
        if isinstance(kind, str) and kind:
            return kind.lower(), 8
    return SHORT_DTYPE[dtype], 16


def _sliding_layers(r: _Reader, num_layers: int) -> tuple[int | None, int, int]:
    """(window, sliding layers, linear-attention layers) from layer_types or the Qwen2 keys."""
    cfg = r.cfg
    window = r.opt_int("sliding_window")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
        linear = sum(1 for t in layer_types if t == "linear_attention")
        return (window if sliding else None), sliding, linear
    if window is None:
        return None, 0, 0
    if "use_sliding_window" in cfg:
        # Qwen2-style: the window applies from layer max_window_layers on, and only if enabled.
        if not cfg.get("use_sliding_window"):
            return None, 0, 0
        first = r.opt_int("max_window_layers") or 0
        sliding = max(0, num_layers - first)
        return (window if sliding else None), sliding, 0
    return window, num_layers, 0  # Mistral-style: every layer


def _estimate_params(r: _Reader, spec: ModelSpec) -> int:
    """A dims-only parameter estimate for a folder without weights (decoder layers + embeddings)."""
    h, layers = spec.hidden_size, spec.num_layers
    heads, kv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if spec.attention is AttentionKind.MLA:
        rank = r.req_int("kv_lora_rank")
        rope = r.req_int("qk_rope_head_dim")
        nope = r.opt_int("qk_nope_head_dim") or hd - rope
        v_dim = r.opt_int("v_head_dim") or nope
        q_rank = r.opt_int("q_lora_rank")
        q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        attn = q + h * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * h
    else:
        attn = 2 * h * heads * hd + 2 * h * kv * hd
    experts = spec.num_experts
    dense_mlp = 3 * h * spec.intermediate_size
    if experts:
        moe_inter = r.opt_int("moe_intermediate_size") or spec.intermediate_size
        shared_inter = r.opt_int("shared_expert_intermediate_size")
        shared = r.opt_int("n_shared_experts") or (1 if shared_inter else 0)
        moe_mlp = 3 * h * (experts * moe_inter + shared * (shared_inter or moe_inter)) + h * experts
        dense_layers = min(layers, r.opt_int("first_k_dense_replace") or 0)
        mlp = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp = layers * dense_mlp
    tied = bool(r.cfg.get("tie_word_embeddings", False))
    embeddings = spec.vocab_size * h * (1 if tied else 2)
    return layers * (attn + 2 * h) + mlp + embeddings + h


def spec_from_folder(path: Path) -> ModelSpec:
    """Read a local Hugging Face model folder (config.json + safetensors) into a ModelSpec."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise BadInputError(
            f"no config.json in {folder}",
            hint="pass a Hugging Face model folder, or a registry name (see `pretuner models`)",
        )
    outer = load_json(config_path)
    r = _Reader(_text_config(outer), config_path)

    num_layers = r.req_int(*_LAYERS)
    hidden = r.req_int(*_HIDDEN)
    heads = r.req_int(*_HEADS)
    if heads > hidden:
        raise broken(f"{config_path}: num_attention_heads {heads:,} is above hidden_size "
                     f"{hidden:,}; a head has at least one dimension")
    kv_heads = r.opt_int(*_KV_HEADS) or heads
    kv_lora_rank = r.opt_int("kv_lora_rank")
    qk_rope: int | None = None
    if kv_lora_rank:
        attention = AttentionKind.MLA
        qk_rope = r.req_int("qk_rope_head_dim")
        head_dim = (r.opt_int("qk_nope_head_dim") or 0) + qk_rope
    else:
        kv_lora_rank = None
        attention = (
            AttentionKind.MHA if kv_heads == heads
            else AttentionKind.MQA if kv_heads == 1
            else AttentionKind.GQA
        )
        head_dim = r.opt_int("head_dim") or hidden // heads
    window, sliding_layers, linear_layers = _sliding_layers(r, num_layers)
    dtype, dtype_note = _dtype(r.cfg)
    fmt, bits = _weights_format_name(folder, r.cfg, dtype)

    notes = [f"Read from {folder}."]
    if dtype_note:
        notes.append(dtype_note)
    extra: dict[str, str] = {}
    if linear_layers:
        extra["linear_attention_layers"] = str(linear_layers)
        notes.append(
            f"{linear_layers} of {num_layers} layers use linear attention; the KV math counts "
            "them as full attention (conservative)."
        )

    preproc_path = folder / "preprocessor_config.json"
    preproc = load_json(preproc_path) if preproc_path.is_file() else None
    vision, vision_note = vision_from_config(outer, preproc, str(config_path), str(preproc_path))
    if vision_note:
        notes.append(vision_note)
    hf_id = named_hub_id(outer) or folder.resolve().name
    spec = ModelSpec(  # sized below: from the checkpoint, else estimated from these dims
        name=folder.resolve().name, hf_id=hf_id, attention=attention, total_params=0,
        dtype=dtype, weights=(), num_layers=num_layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=r.req_int(*_VOCAB), intermediate_size=r.req_int(*_INTERMEDIATE),
        num_experts=r.opt_int(*_EXPERTS) or 0,
        num_experts_per_tok=r.opt_int("num_experts_per_tok", "experts_per_token") or 0,
        moe_intermediate_size=r.opt_int("moe_intermediate_size"),
        max_position_embeddings=r.req_int(
            "max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"),
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope, sliding_window=window,
        sliding_window_layers=sliding_layers, extra=extra, vision=vision,
        quantization=quantization_from_config(outer) or quantization_from_config(r.cfg),
    )  # fmt: skip

    size = checkpoint_size(folder, fmt, bits)
    if size is not None:
        total_params = size.params
        weights = WeightsFormat(fmt, size.total_bytes, "measured")
        notes.append(f"Weights sized from {size.how}.")
    else:
        total_params = _estimate_params(r, spec)
        bpp = BYTES_PER_PARAM.get(fmt, float(DTYPE_BYTES[dtype]))
        weights = WeightsFormat(fmt, round(total_params * bpp), "derived")
        notes.append(
            "No checkpoint in the folder: parameters estimated from the config dims "
            "(decoder layers and embeddings only)."
        )
    if total_params <= 0:
        raise broken(f"{folder}: the checkpoint holds no tensors")
    if total_params > MAX_PARAMS:
        raise broken(f"{folder}: {total_params:,} parameters is beyond any model "
                     f"(at most {MAX_PARAMS:,}); its config.json sizes are wrong")
    log.debug("spec from %s: %s, %s bytes", folder, fmt, weights.total_bytes)
    return replace(spec, total_params=total_params, weights=(weights,), notes=" ".join(notes))
