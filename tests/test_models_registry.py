"""The built-in registry: every file loads, names resolve, dims match the real configs."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from pretuner.errors import BadInputError, UnknownModelError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens
from pretuner.models import AttentionKind, builtin_specs, lookup
from pretuner.models.registry import spec_from_dict
from pretuner.units import GIB

# Copied by hand from each model's Hugging Face config.json (text_config for the VL models):
# (layers, hidden, heads, kv heads, head_dim, vocab, intermediate, max positions, experts)
CONFIG_DIMS: dict[str, tuple[int, int, int, int, int, int, int, int, int]] = {
    "deepseek-v3": (61, 7168, 128, 128, 192, 129280, 18432, 163840, 256),
    "deepseek-r1": (61, 7168, 128, 128, 192, 129280, 18432, 163840, 256),
    "deepseek-r1-distill-llama-70b": (80, 8192, 64, 8, 128, 128256, 28672, 131072, 0),
    "glm-4.5": (92, 5120, 96, 8, 128, 151552, 12288, 131072, 160),
    "gpt-oss-120b": (36, 2880, 64, 8, 64, 201088, 2880, 131072, 128),
    "llama-3.1-8b-instruct": (32, 4096, 32, 8, 128, 128256, 14336, 131072, 0),
    "qwen2.5-7b-instruct": (28, 3584, 28, 4, 128, 152064, 18944, 32768, 0),
    "qwen2.5-72b-instruct": (80, 8192, 64, 8, 128, 152064, 29568, 32768, 0),
    "qwen3-8b": (36, 4096, 32, 8, 128, 151936, 12288, 40960, 0),
    "qwen3-32b": (64, 5120, 64, 8, 128, 151936, 25600, 40960, 0),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 151936, 6144, 40960, 128),
    "qwen3-235b-a22b": (94, 4096, 64, 4, 128, 151936, 12288, 40960, 128),
    "qwen3-vl-8b-instruct": (36, 4096, 32, 8, 128, 151936, 12288, 262144, 0),
    "qwen3-vl-32b-instruct": (64, 5120, 64, 8, 128, 151936, 25600, 262144, 0),
}

# Checkpoint totals read from the published model.safetensors.index.json files.
MEASURED_BYTES = {
    ("deepseek-v3", "fp8"): 688_586_727_753,
    ("qwen2.5-7b-instruct", "bf16"): 15_231_233_024,
    ("llama-3.1-8b-instruct", "bf16"): 16_060_522_496,
}


def _data_files() -> list[Any]:
    data = resources.files("pretuner.models").joinpath("data")
    return sorted((e for e in data.iterdir() if e.name.endswith(".json")), key=lambda e: e.name)


def test_every_data_file_loads_and_is_named_after_its_model() -> None:
    files = _data_files()
    for entry in files:
        spec = spec_from_dict(json.loads(entry.read_text("utf-8")), entry.name)
        assert entry.name == f"{spec.name}.json"
    names = {s.name for s in builtin_specs()}
    assert len(names) == len(files)
    assert set(CONFIG_DIMS) <= names  # the models the brief requires; others may be added


@pytest.mark.parametrize("name", sorted(CONFIG_DIMS))
def test_dims_match_the_hf_config(name: str) -> None:
    spec = lookup(name)
    layers, hidden, heads, kv, head_dim, vocab, inter, max_pos, experts = CONFIG_DIMS[name]
    assert spec.num_layers == layers
    assert spec.hidden_size == hidden
    assert spec.num_heads == heads
    assert spec.num_kv_heads == kv
    assert spec.head_dim == head_dim
    assert spec.vocab_size == vocab
    assert spec.intermediate_size == inter
    assert spec.max_position_embeddings == max_pos
    assert spec.num_experts == experts
    assert spec.dtype == "bfloat16"


@pytest.mark.parametrize("name", sorted(s.name for s in builtin_specs() if s.num_experts))
def test_moe_top_k_and_width_account_for_the_idle_experts(name: str) -> None:
    """The experts' top-k and width (what the emulator and plan size the fused-MoE buffers
    with) agree with the total and active parameters: the gap is the idle experts' weights."""
    spec = lookup(name)
    dense_layers = {"deepseek-v3": 3, "deepseek-r1": 3, "glm-4.5": 3}.get(name, 0)
    idle = (spec.num_layers - dense_layers) * (spec.num_experts - spec.num_experts_per_tok)
    assert spec.moe_intermediate_size is not None
    idle_params = idle * 3 * spec.hidden_size * spec.moe_intermediate_size
    assert spec.total_params - idle_params == pytest.approx(spec.active_params, rel=0.03)


@pytest.mark.parametrize("name", sorted(CONFIG_DIMS))
def test_spec_is_self_consistent(name: str) -> None:
    spec = lookup(name)
    formats = {w.name: w for w in spec.weights}
    assert {"bf16", "w8a8"} <= set(formats)
    assert all(w.source in ("measured", "derived") for w in spec.weights)
    # bf16 is two bytes per parameter, derived or read from the index.
    assert formats["bf16"].total_bytes == 2 * spec.total_params
    # w8a8 keeps embeddings/norms (and a vision tower) in bf16: over one byte per parameter.
    assert spec.total_params < formats["w8a8"].total_bytes < 1.25 * spec.total_params
    assert spec.num_heads % spec.num_kv_heads == 0
    if spec.num_experts:
        assert spec.active_params is not None
        assert 0 < spec.active_params < spec.total_params
    else:
        assert spec.active_params is None
    expected_kind = {
        spec.num_heads: AttentionKind.MHA, 1: AttentionKind.MQA
    }.get(spec.num_kv_heads, AttentionKind.GQA)
    if spec.attention is not AttentionKind.MLA:
        assert spec.attention is expected_kind
    assert spec.notes


@pytest.mark.parametrize(("name", "fmt"), sorted(MEASURED_BYTES))
def test_measured_checkpoint_sizes(name: str, fmt: str) -> None:
    weights = lookup(name).weights_format(fmt)
    assert weights.total_bytes == MEASURED_BYTES[(name, fmt)]
    assert weights.source == "measured"


def test_mla_and_sliding_window_fields() -> None:
    for name in ("deepseek-v3", "deepseek-r1"):
        spec = lookup(name)
        assert spec.attention is AttentionKind.MLA
        assert (spec.kv_lora_rank, spec.qk_rope_head_dim) == (512, 64)
        assert spec.weights_format("fp8").total_bytes == 688_586_727_753
    oss = lookup("gpt-oss-120b")
    assert (oss.sliding_window, oss.sliding_window_layers) == (128, 18)
    mxfp4 = oss.weights_format("mxfp4")
    assert 0.5 < mxfp4.total_bytes / oss.total_params < 0.6


def test_vl_params_include_the_vision_tower() -> None:
    # Same text stack as Qwen3-8B; the difference is the vision encoder (~0.58e9 params).
    diff = lookup("qwen3-vl-8b-instruct").total_params - lookup("qwen3-8b").total_params
    assert 0.5e9 < diff < 0.65e9


@pytest.mark.parametrize(
    "alias",
    ["deepseek-v3", "DeepSeek-V3", "deepseek-ai/DeepSeek-V3", "DEEPSEEK-AI/deepseek-v3", " dsv3 "],
)
def test_aliases_are_case_insensitive(alias: str) -> None:
    assert lookup(alias).name == "deepseek-v3"


def test_hf_id_and_repo_name_resolve_for_every_model() -> None:
    for spec in builtin_specs():
        assert lookup(spec.hf_id) is spec
        assert lookup(spec.hf_id.split("/")[-1].upper()) is spec
        for alias in spec.aliases:
            assert lookup(alias) is spec


def test_no_alias_names_two_models() -> None:
    seen: dict[str, str] = {}
    for spec in builtin_specs():
        keys = {spec.name, spec.hf_id, spec.hf_id.split("/")[-1], *spec.aliases}
        for key in {k.strip().lower() for k in keys}:
            assert key not in seen, f"{key!r} names both {seen[key]} and {spec.name}"
            seen[key] = spec.name


def test_unknown_model_lists_close_matches() -> None:
    with pytest.raises(UnknownModelError) as info:
        lookup("deepseek-v4")
    assert str(info.value) == "unknown model 'deepseek-v4'; did you mean deepseek-v3, deepseek-r1?"
    assert info.value.exit_code == 2


def test_unknown_model_without_match_points_to_the_list() -> None:
    with pytest.raises(UnknownModelError, match="run `pretuner models`"):
        lookup("zzzz-not-a-model")


def _minimal() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("pretuner.models").joinpath("data/qwen3-8b.json").read_text("utf-8")
    )
    return data


def test_unknown_key_in_a_spec_is_rejected() -> None:
    data = _minimal()
    data["num_layer"] = 36
    with pytest.raises(BadInputError, match=r"x\.json: unknown key\(s\) num_layer"):
        spec_from_dict(data, "x.json")


def test_unknown_key_in_weights_is_rejected() -> None:
    data = _minimal()
    data["weights"] = [{"name": "bf16", "total_bytes": 1, "sorce": "derived"}]
    with pytest.raises(BadInputError, match="unknown weights key"):
        spec_from_dict(data, "x.json")


def test_qwen3_vl_8b_tp2_real_figures() -> None:
    bpt = kv_bytes_per_token(lookup("Qwen/Qwen3-VL-8B-Instruct"), tp=2)
    assert bpt == 73_728
    assert kv_tokens(int(44.30 * GIB), bpt, 128) == 645_120
    assert kv_tokens(int(43.54 * GIB), bpt, 128) == 633_984


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-r1"])
def test_deepseek_mla_kv_bytes(name: str, tp: int) -> None:
    spec = lookup(name)
    assert kv_bytes_per_token(spec, tp=tp) == 70_272
    assert kv_bytes_per_token(spec, tp=tp, kv_dtype="int8-mla") == 39_040


@pytest.mark.parametrize(
    ("name", "tp", "expected"),
    [
        ("qwen3-8b", 1, 36 * 2 * 8 * 128 * 2),
        ("qwen3-235b-a22b", 8, 94 * 2 * 1 * 128 * 2),  # 4 KV heads replicated over 8 ranks
        ("gpt-oss-120b", 2, 36 * 2 * 4 * 64 * 2),
        ("glm-4.5", 8, 92 * 2 * 1 * 128 * 2),
        ("qwen2.5-7b-instruct", 4, 28 * 2 * 1 * 128 * 2),
    ],
)
def test_gqa_kv_bytes(name: str, tp: int, expected: int) -> None:
    assert kv_bytes_per_token(lookup(name), tp=tp) == expected
