"""`pretuner models` and `pretuner models show`, through the console entry point in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretuner.models import builtin_specs
from tests.helpers import invoke


def test_models_lists_every_model_with_units() -> None:
    result = invoke("models")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "HF", "ID"]
    assert "PARAMS (1e9)" in lines[0]
    assert "KV BYTES/TOKEN (TP1)" in lines[0]
    for spec in builtin_specs():
        assert any(line.startswith(spec.name + " ") for line in lines), spec.name
    row = next(line for line in lines if line.startswith("deepseek-v3 "))
    assert row.split()[1:5] == ["deepseek-ai/DeepSeek-V3", "mla", "61", "671.03"]
    assert row.endswith("70,272")


def test_models_json() -> None:
    result = invoke("models", "--json")
    assert result.returncode == 0, result.stderr
    models = {m["name"]: m for m in json.loads(result.stdout)["models"]}
    assert set(models) == {s.name for s in builtin_specs()}
    assert models["deepseek-r1"]["kv_bytes_per_token_tp1"] == 70_272
    assert models["qwen3-vl-8b-instruct"]["kv_bytes_per_token_tp1"] == 147_456
    assert models["gpt-oss-120b"]["attention"] == "gqa"


def test_show_prints_every_field_with_units() -> None:
    result = invoke("models", "show", "DeepSeek-V3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("deepseek-v3\n")
    for fragment in (
        "HF id:", "deepseek-ai/DeepSeek-V3",
        "kv_lora_rank 512", "qk_rope_head_dim 64",
        "7,168 elements", "129,280 tokens", "163,840 tokens",
        "671,026,419,200 (671.03e9)", "256 per MoE layer",
        "688,586,727,753", "641.30 GiB", "measured", "derived",
        "TP 16", "70,272 B", "bfloat16 (2 B/element)",
    ):
        assert fragment in out, fragment


def test_show_json_has_kv_per_tp_and_invalid_tps() -> None:
    result = invoke("models", "show", "Qwen/Qwen2.5-7B-Instruct", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["name"] == "qwen2.5-7b-instruct"
    assert data["kv_bytes_per_token"] == {"1": 57_344, "2": 28_672, "4": 14_336}
    assert set(data["kv_tp_not_valid"]) == {"8", "16"}
    assert "not divisible by --tp 8" in data["kv_tp_not_valid"]["8"]
    bf16 = next(w for w in data["weights"] if w["name"] == "bf16")
    assert bf16 == {
        "name": "bf16", "total_bytes": 15_231_233_024, "total_gib": 14.19, "source": "measured"
    }


def test_show_text_marks_invalid_tp() -> None:
    result = invoke("models", "show", "qwen2.5-7b-instruct")
    assert result.returncode == 0, result.stderr
    assert "TP 8   not valid: qwen2.5-7b-instruct has 28 attention heads" in result.stdout


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("deepseek-v4", "did you mean deepseek-v3, deepseek-r1?"), ("qwen3-9b", "qwen3-8b")],
)
def test_unknown_model_exits_2_with_one_line(name: str, suggestion: str) -> None:
    result = invoke("models", "show", name)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"pretuner: error: unknown model '{name}'")
    assert suggestion in lines[0]


def test_show_a_local_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    config = {
        "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": 1000, "intermediate_size": 4096,
        "max_position_embeddings": 8192, "torch_dtype": "float16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 123456}}')
    result = invoke("models", "show", str(folder), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["name"] == "my-model"
    assert data["dtype"] == "float16"
    assert data["weights"][0]["name"] == "fp16"
    assert data["weights"][0]["total_bytes"] == 123_456
    assert data["kv_bytes_per_token"]["1"] == 4 * 2 * 4 * 64 * 2


def test_show_a_broken_folder_exits_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    result = invoke("models", "show", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("pretuner: error: ")
    assert "config.json is not valid JSON" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
