"""`pretuner script` and `pretuner presets` on a real V1 run record: one `pretuner run --engine
vllm` on the emulated H100 (real server processes), then its startup files and its preset."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pretuner.presets.model import (
    check_preset,
    load_preset_file,
    preset_from_dict,
    preset_from_report,
)
from pretuner.report.records import RunReport, read_report
from tests.helpers import V1_QWEN_80_8K, FinishedRun, cli_env, invoke

pytestmark = pytest.mark.slow

R01_WORDS = ("ASCEND_TOTAL_MEMORY_GB", "vLLM_MODEL_MEMORY_USE_GB", "model-use", "MODEL_MEMORY")


@pytest.fixture(scope="module")
def v1_run(finished_run: Callable[..., FinishedRun]) -> Path:
    run = finished_run(*V1_QWEN_80_8K)
    assert run.proc.returncode == 0, run.proc.stderr
    return run.folder


def report(run: Path) -> dict[str, Any]:
    rep: dict[str, Any] = json.loads((run / "report.json").read_text())
    return rep


def exec_argv(script: str) -> list[str]:
    line = next(x for x in script.splitlines() if x.startswith("exec "))
    words = shlex.split(line)
    assert words[0] == "exec"
    assert words[-1] == "$@"
    return words[1:-1]


def bash_n(text: str) -> None:
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-"], input=text, text=True, check=True)


def test_script_renders_the_command_the_run_proved(v1_run: Path, tmp_path: Path) -> None:
    rep = report(v1_run)
    final = rep["final"]
    kv = rep["derivation"]["kv_cache_memory_bytes"]
    out = tmp_path / "files"
    proc = invoke("script", str(v1_run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    files = {p.name: p.read_text() for p in out.iterdir()}
    assert set(files) == {"serve.sh", "tuned.env", "vllm-config.yaml", "pretuner-serve.service",
                          "pretuner-guard.sh"}
    serve = files["serve.sh"]
    # A simulated run: the real engine's command with the run's flags, byte for byte.
    assert rep["simulated"]
    assert exec_argv(serve) == final["engine_serve_command"]
    assert f"--kv-cache-memory-bytes {kv}" in serve
    assert "SIMULATED" in serve
    assert f"kv-cache-memory-bytes: {kv}" in files["vllm-config.yaml"]
    assert f"max-model-len: {final['max_model_len']}" in files["vllm-config.yaml"]
    assert f"--kv-cache-memory-bytes {kv}" in files["pretuner-serve.service"]
    assert "EnvironmentFile=/etc/pretuner/tuned.env" in files["pretuner-serve.service"]
    for name, text in files.items():
        for word in R01_WORDS:
            assert word not in text, (name, word)
    bash_n(serve)
    bash_n(files["tuned.env"])
    bash_n(files["pretuner-guard.sh"])


def test_the_runs_serve_sh_refuses_another_device(v1_run: Path, tmp_path: Path) -> None:
    """The rule: the run's own serve.sh starts the engine on the device the proof ran on (the
    emulated H100's nvidia-smi) and refuses, in one line, on another (the emulated A100 80 GB);
    PRETUNER_SKIP_GUARD=1 starts it there, unproven."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text('#!/bin/sh\necho "started vllm $*"\n')
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m pretuner.sim nvidia-smi "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = cli_env(PATH=f"{bin_dir}:{os.environ['PATH']}", PRETUNER_SIM_PROFILE="h100-80",
                  PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def serve(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(v1_run / "serve.sh")], env=env | extra,
                              capture_output=True, text=True, timeout=60, check=False)

    same = serve()
    assert same.returncode == 0, same.stderr
    assert same.stdout.startswith("started vllm serve ")
    # the device's name, recorded as its tool prints it (checked above: the same name starts);
    # the emulated engine has no torch or CUDA to record
    shown = subprocess.run([str(bin_dir / "nvidia-smi"), "--query-gpu=name",
                            "--format=csv,noheader", "-i", "0"], env=env, capture_output=True,
                           text=True, check=True, timeout=60).stdout.strip()
    assert (report(v1_run)["device_name"], report(v1_run)["stack"]) == (shown, None)
    assert (f"- fingerprint (serve.sh checks it): a software stack not recorded; device {shown} "
            "(as its tool names it)") in (v1_run / "report.md").read_text()
    other = serve(PRETUNER_SIM_PROFILE="a100-80")
    assert other.returncode == 78
    assert other.stdout == ""
    assert len(other.stderr.splitlines()) == 1
    total = report(v1_run)["steps"][-1]["device_total_mib"]
    assert f"the proof ran on {total} MiB" in other.stderr
    assert "pretuner run --model qwen3-8b --engine vllm" in other.stderr
    forced = serve(PRETUNER_SIM_PROFILE="a100-80", PRETUNER_SKIP_GUARD="1")
    assert forced.returncode == 0
    assert "starting UNPROVEN" in forced.stderr


def test_the_run_folder_holds_what_script_writes(v1_run: Path, tmp_path: Path) -> None:
    """One renderer: the run folder's startup files are `pretuner script RUN`'s, byte for byte
    (vLLM's `--config` spelling, only the variables serve.sh reads)."""
    out = tmp_path / "files"
    assert invoke("script", str(v1_run), "--out", str(out)).returncode == 0
    for path in out.iterdir():
        assert (v1_run / path.name).read_text() == path.read_text(), path.name
    assert "PRETUNER_" not in (out / "tuned.env").read_text()
    assert "max_model_len" not in (out / "vllm-config.yaml").read_text()


def test_script_ray_target_for_a_v1_run(v1_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "ray"
    proc = invoke("script", str(v1_run), "--target", "ray", "--nic", "ens3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    head = (out / "ray-head.sh").read_text()
    worker = (out / "ray-worker.sh").read_text()
    assert "ray start --head --port=6379" in head
    assert 'ray start --address="$head_ip:"6379' in worker
    argv = exec_argv(head)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert argv[-2:] == ["--distributed-executor-backend", "ray"]
    assert f"--kv-cache-memory-bytes {report(v1_run)['derivation']['kv_cache_memory_bytes']}" in head
    for text in (head, worker):
        assert "? GPU'" in text
        for word in R01_WORDS:
            assert word not in text
        bash_n(text)


def test_engine_version_is_not_for_a_v1_run(v1_run: Path) -> None:
    proc = invoke("script", str(v1_run), "--engine-version", "0.5")
    assert proc.returncode == 2
    assert "engine comes from the preset" in proc.stderr


def test_presets_add_round_trips_a_v1_run(v1_run: Path, tmp_path: Path) -> None:
    rep = report(v1_run)
    proc = invoke("presets", "add", str(v1_run), "--name", "my-v1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "my-v1.json"
    data = json.loads(path.read_text())
    assert data["kv_basis"] == "pinned"
    assert data["kind"] == "simulated"
    assert data["engine"] == "vllm"
    assert data["kv_cache_memory_bytes"] == rep["derivation"]["kv_cache_memory_bytes"]
    assert data["kv_tokens"] == rep["final"]["kv_tokens"]
    p = load_preset_file(path)
    assert check_preset(p) == []
    record = read_report(v1_run)
    assert isinstance(record, RunReport)
    assert p == preset_from_report(record, name="my-v1", date=p.date)

    show = invoke("presets", "show", str(path))
    assert show.returncode == 0, show.stderr
    assert "GiB pinned" in show.stdout
    assert "engine: vllm" in show.stdout
    assert f"--kv-cache-memory-bytes {data['kv_cache_memory_bytes']}" in show.stdout

    from_preset = invoke("script", "--preset", str(path), "--target", "serve")
    from_run = invoke("script", str(v1_run), "--target", "serve")
    assert from_preset.returncode == 0, from_preset.stderr
    assert exec_argv(from_preset.stdout) == exec_argv(from_run.stdout)

    tampered = data | {"kv_tokens": data["kv_tokens"] + 16}
    assert check_preset(preset_from_dict(tampered, "tampered"))
