"""A ModelSpec from a local Hugging Face model folder, sized without loading any weights.

Only `config.json`, the checkpoint index and the safetensors *headers* are read: a
safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets}}`, then the tensor data, which is never touched.
A 700 GB checkpoint is sized from a few megabytes of headers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretuner.errors import BadInputError
from pretuner.models.quant import from_config as quantization_from_config
from pretuner.models.spec import DTYPE_BYTES, AttentionKind, ModelSpec, WeightsFormat
from pretuner.models.vision import vision_from_config

log = logging.getLogger(__name__)

# The safetensors format itself refuses headers above 100 MB; a bigger claim means garbage.
MAX_HEADER_BYTES = 100 * 1024 * 1024

_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Tensors that quantized checkpoints store beside the weights (scales, zero points, offsets):
# they take bytes but are not model parameters.
_AUX_SUFFIXES = (
    "_scale_inv", "_scale", "_scales", ".scales", "_offset", ".qzeros", ".g_idx",
    ".deq_scale", ".quant_bias", "_zero_point",
)

# Bytes per parameter by checkpoint format, to turn an index total into a parameter count
# when the shard headers are not at hand (REFERENCE section 6).
_BYTES_PER_PARAM: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0002, "w8a8": 1.0, "w8a16": 1.0,
    "int8": 1.0, "mxfp4": 0.53, "awq": 0.52, "gptq": 0.52,
}

_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

_HINT_REDOWNLOAD = "re-download that file (the download may be incomplete) or remove it"


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """What one safetensors header says: tensor bytes and parameter count."""

    path: Path
    header_bytes: int
    tensor_bytes: int
    params: int


@dataclass(frozen=True, slots=True)
class CheckpointSize:
    """A folder's weights: total bytes, parameter count, and how both were found."""

    total_bytes: int
    params: int
    how: str


def _load_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text("utf-8")
    except OSError as err:
        raise BadInputError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise BadInputError(f"{path} is not UTF-8 text", hint=_HINT_REDOWNLOAD) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadInputError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})",
            hint=_HINT_REDOWNLOAD,
        ) from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _tensor_params(name: str, entry: dict[str, Any], quant_bits: int) -> int:
    """Parameters a stored tensor holds: packed low-bit tensors hold several per element."""
    if name.endswith(_AUX_SUFFIXES):
        return 0
    elements = int(math.prod(entry["shape"]))
    dtype = str(entry["dtype"])
    if name.endswith("_blocks") and dtype == "U8":
        return elements * 2  # MXFP4: two 4-bit values per byte
    if name.endswith(".qweight") and dtype in ("I32", "U32"):
        return elements * (32 // quant_bits)  # GPTQ/AWQ pack 32 // bits values per int32
    return elements


def read_safetensors_header(path: Path, *, quant_bits: int = 4) -> SafetensorsHeader:
    """Parse one file's header and check it against the file size; never reads tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise BadInputError(
                    f"{path} is {size} bytes, too short to be a safetensors file",
                    hint=_HINT_REDOWNLOAD,
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len == 0 or header_len > min(MAX_HEADER_BYTES, size - 8):
                raise BadInputError(
                    f"{path}: safetensors header claims {header_len:,} bytes but the file is "
                    f"{size:,} bytes; the file is truncated or not safetensors",
                    hint=_HINT_REDOWNLOAD,
                )
            raw = f.read(header_len)
    except OSError as err:
        raise BadInputError(f"cannot read {path}: {err.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadInputError(
            f"{path}: safetensors header is not valid JSON; the file is corrupt",
            hint=_HINT_REDOWNLOAD,
        ) from None
    if not isinstance(header, dict):
        raise BadInputError(
            f"{path}: safetensors header is not a JSON object", hint=_HINT_REDOWNLOAD
        )
    data_bytes = size - 8 - header_len
    tensor_bytes = 0
    params = 0
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not _valid_entry(entry):
            raise BadInputError(
                f"{path}: malformed safetensors entry for tensor {name!r}", hint=_HINT_REDOWNLOAD
            )
        start, end = entry["data_offsets"]
        tensor_bytes += end - start
        data_end = max(data_end, end)
        params += _tensor_params(name, entry, quant_bits)
    if data_end > data_bytes:
        raise BadInputError(
            f"{path} is {size:,} bytes but its header places tensor data up to byte "
            f"{8 + header_len + data_end:,}; the download is incomplete",
            hint=_HINT_REDOWNLOAD,
        )
    return SafetensorsHeader(path, header_len, tensor_bytes, params)


def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2:
        return False
    start, end = offsets
    return _is_count(start) and _is_count(end) and start <= end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def checkpoint_size(folder: Path, fmt: str, quant_bits: int = 4) -> CheckpointSize | None:
    """Bytes and parameters of the folder's weights, or None when it holds no checkpoint.

    The index's `metadata.total_size` gives the bytes when present; the shard headers give
    the parameter count when every shard is present (else bytes / bytes-per-param).
    """
    index_total: int | None = None
    shard_names: list[str] = []
    for index_name in _INDEX_FILES:
        index_path = folder / index_name
        if not index_path.is_file():
            continue
        index = _load_json(index_path)
        metadata = index.get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        if not _is_count(total) or total == 0:
            raise BadInputError(
                f"{index_path} has no positive integer metadata.total_size",
                hint=_HINT_REDOWNLOAD,
            )
        index_total = total
        weight_map = index.get("weight_map")
        if isinstance(weight_map, dict):
            shard_names = sorted({v for v in weight_map.values() if isinstance(v, str)})
        break

    if shard_names:
        shards = [folder / name for name in shard_names if name.endswith(".safetensors")]
        if len(shards) != len(shard_names) or not all(p.is_file() for p in shards):
            shards = []  # shards missing or not safetensors: size from the index alone
    else:
        shards = sorted(folder.glob("*.safetensors"))

    headers = [read_safetensors_header(p, quant_bits=quant_bits) for p in shards]
    if index_total is not None:
        if headers:
            params = sum(h.params for h in headers)
            how = f"index total_size, parameters from {len(headers)} safetensors header(s)"
        else:
            params = round(index_total / _BYTES_PER_PARAM.get(fmt, 2.0))
            how = "index total_size, parameters estimated from bytes per parameter"
        return CheckpointSize(index_total, params, how)
    if headers:
        return CheckpointSize(
            sum(h.tensor_bytes for h in headers),
            sum(h.params for h in headers),
            f"{len(headers)} safetensors header(s)",
        )
    return None


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: VL models nest it under `text_config` (or similar)."""
    for key in ("text_config", "llm_config", "language_config"):
        nested = cfg.get(key)
        if isinstance(nested, dict):
            outer = {k: v for k, v in cfg.items() if not isinstance(v, dict)}
            return {**outer, **nested}
    return cfg


class _Reader:
    """Typed access to config keys, with errors that name the file and the key."""

    def __init__(self, cfg: dict[str, Any], origin: Path) -> None:
        self.cfg = cfg
        self.origin = origin

    def opt_int(self, *keys: str) -> int | None:
        for key in keys:
            value = self.cfg.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadInputError(
                    f"{self.origin}: {key} must be a non-negative integer, got {value!r}"
                )
            return value
        return None

    def req_int(self, *keys: str) -> int:
        value = self.opt_int(*keys)
        if value is None:
            raise BadInputError(
                f"{self.origin} lacks {' / '.join(keys)}",
                hint="is this a decoder LLM's config.json? pass a supported model folder",
            )
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
        kind = _load_json(desc).get("model_quant_type")
        if isinstance(kind, str) and kind:
            return kind.lower(), 8
    return _SHORT_DTYPE[dtype], 16


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


def _estimate_params(r: _Reader, spec_dims: dict[str, int], attention: AttentionKind) -> int:
    """A dims-only parameter estimate for a folder without weights (decoder layers + embeddings)."""
    h, layers = spec_dims["hidden_size"], spec_dims["num_layers"]
    heads, kv, hd = spec_dims["num_heads"], spec_dims["num_kv_heads"], spec_dims["head_dim"]
    if attention is AttentionKind.MLA:
        rank = r.req_int("kv_lora_rank")
        rope = r.req_int("qk_rope_head_dim")
        nope = r.opt_int("qk_nope_head_dim") or hd - rope
        v_dim = r.opt_int("v_head_dim") or nope
        q_rank = r.opt_int("q_lora_rank")
        q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        attn = q + h * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * h
    else:
        attn = 2 * h * heads * hd + 2 * h * kv * hd
    experts = spec_dims["num_experts"]
    dense_mlp = 3 * h * spec_dims["intermediate_size"]
    if experts:
        moe_inter = r.opt_int("moe_intermediate_size") or spec_dims["intermediate_size"]
        shared_inter = r.opt_int("shared_expert_intermediate_size")
        shared = r.opt_int("n_shared_experts") or (1 if shared_inter else 0)
        moe_mlp = 3 * h * (experts * moe_inter + shared * (shared_inter or moe_inter)) + h * experts
        dense_layers = min(layers, r.opt_int("first_k_dense_replace") or 0)
        mlp = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp = layers * dense_mlp
    tied = bool(r.cfg.get("tie_word_embeddings", False))
    embeddings = spec_dims["vocab_size"] * h * (1 if tied else 2)
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
    outer = _load_json(config_path)
    r = _Reader(_text_config(outer), config_path)

    num_layers = r.req_int("num_hidden_layers", "num_layers", "n_layer")
    hidden = r.req_int("hidden_size", "d_model", "n_embd")
    heads = r.req_int("num_attention_heads", "n_head")
    if heads == 0 or num_layers == 0:
        raise BadInputError(f"{config_path}: num_attention_heads and num_hidden_layers must be > 0")
    kv_heads = r.opt_int("num_key_value_heads", "multi_query_group_num") or heads
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
    dims = {
        "num_layers": num_layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": r.req_int("vocab_size", "padded_vocab_size"),
        "intermediate_size": r.req_int(
            "intermediate_size", "ffn_hidden_size", "n_inner", "moe_intermediate_size"
        ),
        "num_experts": r.opt_int("num_experts", "n_routed_experts", "num_local_experts") or 0,
    }
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
    preproc = _load_json(preproc_path) if preproc_path.is_file() else None
    vision, vision_note = vision_from_config(outer, preproc, str(config_path), str(preproc_path))
    if vision_note:
        notes.append(vision_note)

    size = checkpoint_size(folder, fmt, bits)
    if size is not None:
        total_params = size.params
        weights = WeightsFormat(fmt, size.total_bytes, "measured")
        notes.append(f"Weights sized from {size.how}.")
    else:
        total_params = _estimate_params(r, dims, attention)
        bpp = _BYTES_PER_PARAM.get(fmt, float(DTYPE_BYTES[dtype]))
        weights = WeightsFormat(fmt, round(total_params * bpp), "derived")
        notes.append(
            "No checkpoint in the folder: parameters estimated from the config dims "
            "(decoder layers and embeddings only)."
        )
    if total_params <= 0:
        raise BadInputError(f"{folder}: the checkpoint holds no tensors", hint=_HINT_REDOWNLOAD)

    name_or_path = outer.get("_name_or_path")
    hf_id = (
        name_or_path
        if isinstance(name_or_path, str) and name_or_path.count("/") == 1
        and not os.path.isabs(name_or_path)
        else folder.resolve().name
    )
    log.debug("spec from %s: %s, %s bytes", folder, fmt, weights.total_bytes)
    return ModelSpec(
        name=folder.resolve().name,
        hf_id=hf_id,
        attention=attention,
        total_params=total_params,
        dtype=dtype,
        weights=(weights,),
        max_position_embeddings=r.req_int(
            "max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"
        ),
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope,
        sliding_window=window,
        sliding_window_layers=sliding_layers,
        notes=" ".join(notes),
        extra=extra,
        num_layers=dims["num_layers"],
        hidden_size=dims["hidden_size"],
        num_heads=dims["num_heads"],
        num_kv_heads=dims["num_kv_heads"],
        head_dim=dims["head_dim"],
        vocab_size=dims["vocab_size"],
        intermediate_size=dims["intermediate_size"],
        num_experts=dims["num_experts"],
        vision=vision,
        quantization=quantization_from_config(outer) or quantization_from_config(r.cfg),
    )
