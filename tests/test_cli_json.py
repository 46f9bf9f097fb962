"""`--json` means one JSON object on stdout, for results, dry runs and failures alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import invoke


@pytest.mark.parametrize(("args", "error_type"), [
    (("plan", "--model", "no-such-model", "--card", "64"), "UnknownModelError"),
    (("analyze", "/no/such/log", "--model", "qwen3-8b"), "BadInputError"),
    (("scan", "/no/such/log"), "BadInputError"),
])  # fmt: skip
def test_a_failure_under_json_is_a_json_object_too(args: tuple[str, ...], error_type: str) -> None:
    proc = invoke(*args, "--json")
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    assert data["schema_version"] == 2
    assert data["error_type"] == error_type
    assert data["exit_code"] == 2
    assert data["hint"]
    assert proc.stderr.startswith("pretuner: error:")  # the one line stays on stderr


@pytest.mark.parametrize(("engine", "method"), [("auto", "r0.1"), ("vllm", "v1-pinned-kv")])
def test_a_dry_run_under_json_is_the_first_launch_as_data(engine: str, method: str) -> None:
    proc = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert next(iter(data)) == "schema_version"
    assert data["dry_run"] is True
    assert data["method"] == method
    assert data["simulated"] is True
    first = data["first_launch"]
    assert first["settings"]["purpose"] == "prerun"
    assert "--max-model-len" in first["argv"]


def test_presets_list_and_script_speak_json(tmp_path: Path) -> None:
    listed = invoke("presets", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    presets = json.loads(listed.stdout)["presets"]
    assert presets
    assert {"name", "kind", "model"} <= presets[0].keys()
    name = presets[0]["name"]
    printed = invoke("script", "--preset", name, "--target", "serve", "--json")
    assert printed.returncode == 0, printed.stderr
    assert list(json.loads(printed.stdout)["files"]) == ["serve.sh"]
    written = invoke("script", "--preset", name, "--target", "serve", "--json",
                     "--out", str(tmp_path / "deploy"))
    assert written.returncode == 0, written.stderr
    [path] = json.loads(written.stdout)["written"]
    assert Path(path).is_file()


@pytest.mark.parametrize("args", [
    ("plan", "--model", "qwen3-8b", "--card", "64"),
    ("models",),
    ("models", "show", "qwen3-8b"),
    ("presets", "list"),
    ("scan", str(Path(__file__).parent / "fixtures" / "logs" / "ms_cpu_exit.log")),
])  # fmt: skip
def test_every_json_object_starts_with_its_schema_version(args: tuple[str, ...]) -> None:
    proc = invoke(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert list(data)[0] == "schema_version"
    assert data["schema_version"] == 2
