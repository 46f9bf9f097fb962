"""Local Hugging Face folders: config parsing and weight sizing from headers only."""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import AttentionKind, lookup, resolve
from pretuner.models.checkpoint import read_safetensors_header
from pretuner.models.hf import spec_from_folder

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4}

# Trimmed copies of real config.json files (only what the reader looks at, plus noise keys).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    "text_config": {
        "dtype": "bfloat16", "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
        "max_position_embeddings": 262144, "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "vision_config": {"depth": 27, "hidden_size": 1152, "num_heads": 16, "out_hidden_size": 4096},
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 129280,
}
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
    "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128,
    "quantization_config": {"quant_method": "mxfp4"}, "sliding_window": 128,
    "tie_word_embeddings": False, "vocab_size": 201088,
}


def make_folder(root: Path, config: dict[str, Any] | str, name: str = "model") -> Path:
    folder = root / name
    folder.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text, "utf-8")
    return folder


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A real header, then the file extended (sparse) to the size the header claims.

    Returns the tensor bytes. No tensor data is written: the blocks stay unallocated.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * DTYPE_SIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
    os.truncate(path, 8 + len(raw) + offset)
    return offset


def test_config_and_index(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, QWEN3_8B, "Qwen3-8B")
    index = {"metadata": {"total_size": 16_381_470_720}, "weight_map": {"a": "x.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    spec = spec_from_folder(folder)
    registry = lookup("qwen3-8b")
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "intermediate_size", "max_position_embeddings"):
        assert getattr(spec, field) == getattr(registry, field), field
    assert spec.attention is AttentionKind.GQA
    assert spec.sliding_window is None
    assert spec.dtype == "bfloat16"
    assert spec.weights[0].name == "bf16"
    assert spec.weights[0].total_bytes == 16_381_470_720
    assert spec.weights[0].source == "measured"
    # Shards absent: parameters from bytes at 2 B each.
    assert spec.total_params == registry.total_params
    assert spec.name == "Qwen3-8B"
    assert kv_bytes_per_token(spec, tp=2) == kv_bytes_per_token(registry, tp=2)


def test_resolve_takes_a_folder(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, QWEN3_8B)
    assert resolve(str(folder)).num_layers == 36


def test_sparse_700_gb_checkpoint_is_sized_from_headers(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, DEEPSEEK_V3, "DeepSeek-V3")
    expert = ("F8_E4M3", [256, 2048, 7168])  # one layer's routed experts of one projection
    total_bytes = 0
    total_params = 0
    for shard in range(2):
        tensors = {f"model.layers.{shard}.{i}.experts.weight": expert for i in range(95)}
        tensors[f"model.layers.{shard}.experts.weight_scale_inv"] = ("F32", [256, 16, 56])
        total_bytes += write_safetensors(folder / f"model-0000{shard + 1}.safetensors", tensors)
        total_params += 95 * math.prod(expert[1])
    assert total_bytes > 700e9
    on_disk = sum((p.stat().st_blocks * 512) for p in folder.glob("*.safetensors"))
    assert on_disk < 10 * 2**20  # sparse: nothing but headers is allocated

    start = time.monotonic()
    spec = spec_from_folder(folder)
    elapsed = time.monotonic() - start

    assert elapsed < 2.0  # reading 700 GB would take minutes
    weights = spec.weights_format()
    assert weights.name == "fp8"
    assert weights.total_bytes == total_bytes
    assert weights.source == "measured"
    assert spec.total_params == total_params  # scale tensors are not parameters
    assert spec.attention is AttentionKind.MLA
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.head_dim) == (512, 64, 192)
    assert spec.num_experts == 256
    assert (spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2048)
    assert kv_bytes_per_token(spec, tp=16) == 70_272


def test_header_reader_reports_header_size_only(tmp_path: Path) -> None:
    path = tmp_path / "one.safetensors"
    nbytes = write_safetensors(path, {"w": ("BF16", [1024, 1024, 1024])})
    header = read_safetensors_header(path)
    assert header.tensor_bytes == nbytes == 2 * 2**30
    assert header.params == 2**30
    assert header.header_bytes < 4096


def test_index_total_wins_and_shards_give_params(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, QWEN3_8B)
    write_safetensors(folder / "a.safetensors", {"x.weight": ("BF16", [10, 10])})
    write_safetensors(folder / "b.safetensors", {"y.weight": ("BF16", [5, 4])})
    index = {
        "metadata": {"total_size": 240},
        "weight_map": {"x.weight": "a.safetensors", "y.weight": "b.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    spec = spec_from_folder(folder)
    assert spec.weights[0].total_bytes == 240
    assert spec.total_params == 120


def test_vl_config_reads_text_config_and_counts_vision_params(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, QWEN3_VL_8B)
    write_safetensors(folder / "model.safetensors", {
        "model.language_model.embed_tokens.weight": ("BF16", [151936, 4096]),
        "model.visual.blocks.0.attn.qkv.weight": ("BF16", [3456, 1152]),
    })
    spec = spec_from_folder(folder)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (36, 8, 128)
    assert spec.max_position_embeddings == 262144
    assert spec.dtype == "bfloat16"
    assert spec.total_params == 151936 * 4096 + 3456 * 1152
    assert kv_bytes_per_token(spec, tp=2) == 73_728


def test_mxfp4_blocks_count_two_params_per_byte(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, GPT_OSS_120B)
    write_safetensors(folder / "model.safetensors", {
        "model.layers.0.mlp.experts.down_proj_blocks": ("U8", [128, 2880, 90, 16]),
        "model.layers.0.mlp.experts.down_proj_scales": ("U8", [128, 2880, 90]),
        "model.layers.0.mlp.experts.down_proj_bias": ("BF16", [128, 2880]),
    })
    spec = spec_from_folder(folder)
    assert spec.weights[0].name == "mxfp4"
    assert spec.total_params == 128 * 2880 * 2880 + 128 * 2880
    assert (spec.sliding_window, spec.sliding_window_layers) == (128, 18)
    assert spec.num_experts == 128
    assert "bfloat16 assumed" in spec.notes  # gpt-oss names no torch_dtype


def test_qwen2_inactive_sliding_window_is_ignored(tmp_path: Path) -> None:
    cfg = dict(QWEN3_8B, sliding_window=131072, use_sliding_window=False)
    assert spec_from_folder(make_folder(tmp_path, cfg)).sliding_window is None


def test_linear_attention_layers_are_recorded(tmp_path: Path) -> None:
    cfg = dict(QWEN3_8B, layer_types=["linear_attention"] * 27 + ["full_attention"] * 9)
    spec = spec_from_folder(make_folder(tmp_path, cfg))
    assert spec.extra == {"linear_attention_layers": "27"}
    assert spec.sliding_window is None


@pytest.mark.parametrize(
    ("config", "registry_name"),
    [(QWEN3_8B, "qwen3-8b"), (DEEPSEEK_V3, "deepseek-v3"), (GPT_OSS_120B, "gpt-oss-120b")],
)
def test_config_only_folder_estimates_params(
    tmp_path: Path, config: dict[str, Any], registry_name: str
) -> None:
    spec = spec_from_folder(make_folder(tmp_path, config))
    expected = lookup(registry_name).total_params
    assert spec.weights[0].source == "derived"
    assert abs(spec.total_params - expected) / expected < 2e-3
    assert "estimated" in spec.notes


def test_no_config_json(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"^no config\.json in .*; pass a Hugging Face"):
        spec_from_folder(tmp_path)


def test_malformed_config_json(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, '{"num_hidden_layers": 36,')
    with pytest.raises(BadInputError, match=r"config\.json is not valid JSON \(line 1"):
        spec_from_folder(folder)


def test_config_missing_a_dimension(tmp_path: Path) -> None:
    cfg = {k: v for k, v in QWEN3_8B.items() if k != "num_hidden_layers"}
    with pytest.raises(BadInputError, match="config.json lacks num_hidden_layers"):
        spec_from_folder(make_folder(tmp_path, cfg))


def test_config_with_a_non_integer_dimension(tmp_path: Path) -> None:
    cfg = dict(QWEN3_8B, hidden_size="4096")
    with pytest.raises(BadInputError, match="hidden_size must be a non-negative integer"):
        spec_from_folder(make_folder(tmp_path, cfg))


def test_index_without_total_size(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, QWEN3_8B)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(BadInputError, match="no positive integer metadata.total_size"):
        spec_from_folder(folder)


def _broken(folder: Path, content: bytes) -> Path:
    path = folder / "model-00001-of-00002.safetensors"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"\x01\x02", "too short to be a safetensors file"),
        (struct.pack("<Q", 10**12) + b"{}", "header claims 1,000,000,000,000 bytes"),
        (struct.pack("<Q", 8) + b"\xff\xfegarbag", "header is not valid JSON"),
        (struct.pack("<Q", 4) + b"[1] ", "header is not a JSON object"),
        (struct.pack("<Q", 16) + b'{"w": {"a": 1}} ', "malformed safetensors entry for tensor 'w'"),
    ],
)
def test_garbage_safetensors_is_named(tmp_path: Path, content: bytes, fragment: str) -> None:
    folder = make_folder(tmp_path, QWEN3_8B)
    path = _broken(folder, content)
    with pytest.raises(BadInputError) as info:
        spec_from_folder(folder)
    message = str(info.value)
    assert fragment in message
    assert str(path) in message
    assert "re-download" in message
    assert "\n" not in message


def test_truncated_download_is_detected_without_reading_data(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, QWEN3_8B)
    path = folder / "model.safetensors"
    write_safetensors(path, {"w": ("BF16", [1024, 1024])})
    os.truncate(path, path.stat().st_size - 1000)
    with pytest.raises(BadInputError, match="the download is incomplete"):
        spec_from_folder(folder)
