"""Startup scripts: golden files for every target and preset, bash -n, and inert injection.

Refresh the golden files with PRETUNER_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pretuner.deploy.context import ScriptOptions
from pretuner.deploy.render import render_scripts, write_scripts
from pretuner.deploy.targets import Target
from pretuner.errors import BadInputError
from pretuner.presets.model import Preset, builtin_presets, get_preset, preset_from_report
from pretuner.report.records import RunReport, read_report
from tests.helpers import cli_env, invoke

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PRETUNER_UPDATE_GOLDEN") == "1"
ALL = [Target.SERVE, Target.ENV, Target.CONFIG, Target.RAY, Target.SYSTEMD]


def _run_preset() -> Preset:
    rep = read_report(GOLDEN / "run")  # an r0.1 report.json of schema 1: it still reads
    assert isinstance(rep, RunReport)
    return preset_from_report(rep, date="-")


CASES = [(p.name, p, v) for p in builtin_presets() for v in ("0.1", "0.5")]
CASES += [("run", _run_preset(), "0.1"), ("run", _run_preset(), "0.5")]


def _check_golden(folder: Path, files: dict[str, str]) -> None:
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    for name, text in files.items():
        path = folder / name
        assert path.exists(), f"missing golden {path}; run with PRETUNER_UPDATE_GOLDEN=1"
        assert path.read_text() == text, f"{path} differs; refresh with PRETUNER_UPDATE_GOLDEN=1"


@pytest.mark.parametrize(("name", "preset", "version"), CASES, ids=lambda x: str(x)[:40])
def test_golden_every_target(name: str, preset: Preset, version: str) -> None:
    files = render_scripts(preset, ScriptOptions(engine_version=version), ALL)
    assert set(files) == {
        "serve.sh", "tuned.env", "vllm-config.yaml", "ray-head.sh", "ray-worker.sh",
        "pretuner-serve.service",
    }  # fmt: skip
    _check_golden(GOLDEN / name / f"v{version}", files)
    for fname, text in files.items():
        if fname.endswith(".sh") or fname == "tuned.env":
            subprocess.run(["bash", "-n"], input=text, text=True, check=True)
            if shutil.which("shellcheck") and fname.endswith(".sh"):
                subprocess.run(["shellcheck", "-"], input=text, text=True, check=True)


def test_the_proofs_graph_cache_starts_production() -> None:
    """A run whose launches had MindSpore's graph cache on: serve.sh and tuned.env turn it on
    at the same path (MindSpore's default, the current folder, would start cold)."""
    p = _run_preset()
    cache = {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": "/data/ms cache"}
    files = render_scripts(replace(p, env={**p.env, **cache}), ScriptOptions(engine_version="0.1"),
                           [Target.SERVE, Target.ENV])
    for name in ("serve.sh", "tuned.env"):
        assert "MS_COMPILER_CACHE_ENABLE=1" in files[name], name
        assert "MS_COMPILER_CACHE_PATH='/data/ms cache'" in files[name], name
    assert "MS_COMPILER_CACHE" not in render_scripts(p, ScriptOptions(engine_version="0.1"),
                                                     [Target.SERVE])["serve.sh"]


def test_versions_differ_as_documented() -> None:
    p = get_preset("qwen3-vl-8b-tp2-64g-vllm-ascend")
    r01 = render_scripts(p, ScriptOptions(engine_version="0.1"), [Target.SERVE])["serve.sh"]
    v04 = render_scripts(p, ScriptOptions(engine_version="0.4"), [Target.SERVE])["serve.sh"]
    v05 = render_scripts(p, ScriptOptions(engine_version="0.5"), [Target.SERVE])["serve.sh"]
    assert "vllm_mindspore.entrypoints" in r01
    assert "export vLLM_MODEL_MEMORY_USE_GB=17" in r01
    exec04 = next(x for x in v04.splitlines() if x.startswith("exec "))
    assert "vllm-mindspore serve" in exec04
    assert "--kv-cache-memory-bytes" not in exec04
    assert "not enforced" in v04
    assert "MODEL_MEMORY_USE_GB=" not in v04
    assert f"--kv-cache-memory-bytes {645_120 * 73_728}" in v05


def test_all_adds_ray_only_for_multi_node() -> None:
    single = render_scripts(get_preset("qwen3-8b-tp2-20g-vllm"), ScriptOptions(), [Target.ALL])
    multi = render_scripts(
        get_preset("deepseek-r1-w8a8-tp16-2x8x64g"), ScriptOptions(), [Target.ALL]
    )
    assert "ray-head.sh" not in single
    head = multi["ray-head.sh"]
    assert head.index("export HCCL_SOCKET_IFNAME") < head.index("ray start --head")
    assert "expected_npus=16" in head
    assert "--distributed-executor-backend ray" in head


EVIL = "/models/my model/'q\"$(touch PWNED)`touch PWNED2`;$HOME\nx %n"


def test_injection_is_inert(tmp_path: Path) -> None:
    p = get_preset("qwen3-8b-tp2-20g-vllm")
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    stub = stub_dir / "vllm-mindspore"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    opts = ScriptOptions(engine_version="0.5", model_path=EVIL, extra_env={"X_EVIL": EVIL})
    files = render_scripts(p, opts, ALL)
    written = write_scripts(files, tmp_path / "out")
    assert all(os.stat(w).st_mode & stat.S_IXUSR for w in written if w.suffix == ".sh")
    env = {**os.environ, "PATH": f"{stub_dir}:{os.environ['PATH']}"}
    res = subprocess.run(
        ["bash", str(tmp_path / "out" / "serve.sh"), "--extra"],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=True,
    )  # fmt: skip
    argv = json.loads(res.stdout)
    assert argv[:2] == ["serve", EVIL]
    assert argv[-1] == "--extra"
    src = subprocess.run(
        ["bash", "-c", 'set -a; . ./out/tuned.env; printf %s "$X_EVIL"'],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert src.stdout == EVIL
    assert not list(tmp_path.glob("PWNED*"))
    unit = files["pretuner-serve.service"]
    exec_line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert "$$(touch" in exec_line
    assert "%%n" in exec_line
    assert "\\x0a" in exec_line
    # a newline in the path never ends a `#` comment
    assert "# model qwen3-8b (bf16) from " + EVIL.replace("\n", "?") in files["serve.sh"]


def test_write_never_overwrites(tmp_path: Path) -> None:
    files = render_scripts(get_preset("qwen3-8b-tp2-20g-vllm"), ScriptOptions(), [Target.ENV])
    write_scripts(files, tmp_path)
    with pytest.raises(BadInputError, match="never overwrites"):
        write_scripts(files, tmp_path)


def test_bad_values_rejected() -> None:
    p = get_preset("qwen3-8b-tp2-20g-vllm")
    with pytest.raises(BadInputError):
        render_scripts(p, ScriptOptions(extra_env={"BAD NAME": "1"}), [Target.ENV])
    with pytest.raises(BadInputError):
        render_scripts(p, ScriptOptions(install_dir="relative dir"), [Target.SYSTEMD])
    with pytest.raises(BadInputError):
        render_scripts(p, ScriptOptions(engine_version="latest"), [Target.SERVE])


def test_cli_script_and_presets(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(GOLDEN / "run" / "report.json", run_dir / "report.json")
    res = invoke("script", str(run_dir), "--target", "serve")
    assert res.returncode == 0, res.stderr
    assert "==> serve.sh <==" in res.stdout
    assert "vllm_mindspore.entrypoints" in res.stdout
    res = invoke(
        "script", "--preset", "deepseek-r1-w8a8-tp16-2x8x64g", "--out", str(tmp_path / "o")
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "o" / "ray-worker.sh").exists()
    res = invoke("script", "--preset", "nope")
    assert res.returncode == 2
    assert "unknown preset" in res.stderr
    res = invoke("presets", "add", str(run_dir), "--name", "my-run", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "my-run.json").read_text())["kind"] == "simulated"
    res = invoke("presets", "show", "qwen3-8b-tp2-20g-vllm")
    assert res.returncode == 0
    assert "79,040" in res.stdout


def test_presets_add_keeps_a_users_preset_outside_the_package(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(GOLDEN / "run" / "report.json", run_dir / "report.json")
    env = cli_env(PRETUNER_PRESETS_DIR=str(tmp_path / "mine"))
    res = invoke("presets", "add", str(run_dir), "--name", "my-run", env=env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "mine" / "my-run.json").is_file()
    shown = invoke("presets", "show", "my-run", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "my-run (simulated)" in shown.stdout
    assert "my-run" in invoke("presets", "list", env=env).stdout
    assert invoke("script", "--preset", "my-run", "--target", "serve", env=env).returncode == 0
    again = invoke("presets", "add", str(run_dir), "--name", "my-run", env=env)
    assert again.returncode == 2
    assert "exists already" in again.stderr
    # Without the folder set, nothing of it is seen: the package's data was not touched.
    assert "my-run" not in invoke("presets", "list").stdout


def test_presets_add_help_names_out_a_folder() -> None:
    # The preset file is written into --out as NAME.json: the option names a folder, not a file.
    res = invoke("presets", "add", "--help")
    assert res.returncode == 0, res.stderr
    assert "--out DIR" in res.stdout


@pytest.mark.parametrize("name", ["My Preset", "../escaped", "a/b"])
def test_presets_add_refuses_a_name_no_preset_file_can_hold(tmp_path: Path, name: str) -> None:
    # Such a file broke every later `presets list` (its name is refused on reading), and a
    # slash wrote it outside the presets folder.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(GOLDEN / "run" / "report.json", run_dir / "report.json")
    env = cli_env(PRETUNER_PRESETS_DIR=str(tmp_path / "mine" / "presets"))
    res = invoke("presets", "add", str(run_dir), "--name", name, env=env)
    assert res.returncode == 2
    assert f"preset name {name!r} is invalid" in res.stderr
    assert list(tmp_path.rglob("*.json")) == [run_dir / "report.json"]
    assert invoke("presets", "list", env=env).returncode == 0
