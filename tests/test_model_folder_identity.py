"""A local model folder is known by its path and its config.json, never by its base name (issue
28 item 4): a fine-tune in a folder named `qwen3-8b` is not the hub's Qwen/Qwen3-8B, and a run
from another folder serves, reports and presets the folder itself."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pretuner.models import folder_identity
from pretuner.presets.model import find_preset, get_preset, preset_to_json
from tests.helpers import FAST_SIM, cli_env, invoke, run_cli, shared

HUB_CONFIG = json.loads(shared("model-configs", "Qwen--Qwen3-8B.json").read_text())


def _folder(root: Path, name: str, **changes: object) -> Path:
    folder = root / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**HUB_CONFIG, **changes}))
    return folder


def test_a_folder_is_known_by_its_absolute_path_and_config_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path, "qwen3-8b")
    monkeypatch.chdir(tmp_path)
    found = folder_identity("models/qwen3-8b")
    assert found is not None
    assert found.path == str(folder)
    assert found.config_sha256 == hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    assert found.hub_id is None  # its config.json names no hub model
    assert folder_identity("qwen3-8b") is None  # no such folder here: the registry name


def test_a_folder_matches_presets_only_by_the_hub_model_its_config_names(tmp_path: Path) -> None:
    # The shipped preset qwen3-8b-tp2-20g-vllm is the hub model's.
    assert find_preset("qwen3-8b", 20, 2) is not None
    same_name = _folder(tmp_path / "a", "qwen3-8b")  # a fine-tune named like the hub model
    assert find_preset(str(same_name), 20, 2) is None
    saved = _folder(tmp_path / "b", "my-copy", _name_or_path="Qwen/Qwen3-8B")
    hit = find_preset(str(saved), 20, 2)
    assert hit is not None
    assert hit.model == "qwen3-8b"


def test_a_folders_own_preset_is_found_for_that_folder_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `presets add` of a fine-tune in `qwen3-8b/`: its preset's model is the folder's name.
    folder = _folder(tmp_path, "qwen3-8b")
    other = _folder(tmp_path / "b", "qwen3-8b")
    mine = tmp_path / "presets"
    mine.mkdir()
    data = {**preset_to_json(get_preset("qwen3-8b-tp2-20g-vllm")), "name": "my-fine-tune",
            "model_path": str(folder), "kind": "measured"}
    (mine / "my-fine-tune.json").write_text(json.dumps(data))
    monkeypatch.setenv("PRETUNER_PRESETS_DIR", str(mine))
    found = find_preset(str(folder), 20, 2)
    assert found is not None
    assert found.name == "my-fine-tune"
    hub = find_preset("qwen3-8b", 20, 2)  # the hub model: the shipped preset, not the folder's
    assert hub is not None
    assert hub.name == "qwen3-8b-tp2-20g-vllm"
    assert find_preset(str(other), 20, 2) is None


@pytest.mark.slow
def test_a_fine_tune_named_like_a_hub_model_is_served_reported_and_preset_as_its_folder(
        tmp_path: Path) -> None:
    # Seen in issue 28: a fine-tune in `qwen3-8b/` was deployed as `vllm serve Qwen/Qwen3-8B`,
    # and `presets add` checked it against the hub model's KV math. This one has 24 layers
    # (the hub model 36): the hub model's math gives another KV size per token.
    folder = _folder(tmp_path, "qwen3-8b", num_hidden_layers=24)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    proc = run_cli("run", "--model", "../models/qwen3-8b", "--engine", "vllm", "--emulate",
                   "--card", "80", "--max-model-len", "8192", "--out", str(out), "--json",
                   env=cli_env(**FAST_SIM), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads((out / "report.json").read_text())
    sha = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    assert rep["model_folder"] == {"path": str(folder), "config_sha256": sha, "hub_id": None}
    assert f"config.json sha256 {sha}" in (out / "report.md").read_text()
    for name in ("serve.sh", "pretuner-serve.service", "vllm-config.yaml"):
        text = (out / name).read_text()
        assert "Qwen/Qwen3-8B" not in text, name
        assert str(folder) in text, name
    assert f"re-tune: pretuner run --model {folder} " in (out / "serve.sh").read_text()
    presets = tmp_path / "presets"
    presets.mkdir()
    add = invoke("presets", "add", str(out), "--out", str(presets), cwd=elsewhere)
    assert add.returncode == 0, add.stderr
    (written,) = presets.iterdir()
    preset = json.loads(written.read_text())
    assert preset["model_path"] == str(folder)
    assert preset["kv_bytes_per_token"] == 24 * 2 * 8 * 128 * 2  # layers x K,V x heads x dim x B


@pytest.mark.slow
def test_a_folder_not_named_like_any_model_runs_and_presets_from_another_folder(
        tmp_path: Path) -> None:
    # Seen in issue 28: from another folder a V1 run validated, then exited 2 "unknown model".
    folder = _folder(tmp_path, "my-finetune")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    proc = run_cli("run", "--model", str(folder), "--engine", "vllm", "--emulate", "--card", "80",
                   "--max-model-len", "8192", "--out", str(out), env=cli_env(**FAST_SIM),
                   cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert (out / "serve.sh").exists()
    presets = tmp_path / "presets"
    presets.mkdir()
    add = invoke("presets", "add", str(out), "--out", str(presets), cwd=elsewhere)
    assert add.returncode == 0, add.stderr
