"""Before a run folder exists: the real engine must be installed, and it gets a model it can load."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pretuner.engines.mindspore_r01 import MINDSPORE_CPU, R01, SIM, R01Engine
from pretuner.models import resolve
from tests.helpers import cli_env, invoke

REAL = ("run", "--model", "qwen3-8b", "--engine", "vllm-mindspore-r01", "--card", "64")


def test_a_registry_name_goes_to_a_real_server_as_its_hugging_face_id(tmp_path: Path) -> None:
    spec = resolve("qwen3-8b")
    real = R01Engine(R01, False, "0.1.0", "test")
    assert real.model_arg("qwen3-8b", spec) == "Qwen/Qwen3-8B"
    assert real.model_arg(str(tmp_path), spec) == str(tmp_path)
    assert R01Engine(R01, True, None, "test").model_arg("qwen3-8b", spec) == "qwen3-8b"
    assert R01Engine(SIM, True, None, "test").model_arg("qwen3-8b", spec) == "qwen3-8b"
    assert R01Engine(MINDSPORE_CPU, False, None, "test").model_arg("qwen3-8b", spec) == "qwen3-8b"


def _npu_smi(bin_dir: Path) -> Path:
    """An `npu-smi` that shows cards (the emulated tool's table): the machine has NPUs."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "npu-smi"
    tool.write_text(f"#!/bin/sh\nexec {sys.executable} -m pretuner.sim npu-smi \"$@\"\n")
    tool.chmod(0o755)
    return bin_dir


def _path_with_python(tmp_path: Path) -> dict[str, str]:
    bin_dir = _npu_smi(tmp_path / "bin")
    (bin_dir / "python3").symlink_to(sys.executable)
    return cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_missing_engine_is_refused_before_the_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = invoke(*REAL, "--out", str(out), env=_path_with_python(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "cannot import 'vllm_mindspore'" in proc.stderr
    assert "--engine sim" in proc.stderr
    assert not out.exists()


def test_a_missing_server_program_is_refused(tmp_path: Path) -> None:
    env = cli_env(PATH=str(_npu_smi(tmp_path / "bin")))  # NPUs, and no python3 at all
    proc = invoke(*REAL, "--out", str(tmp_path / "run"), env=env)
    assert proc.returncode == 2, proc.stderr
    assert "'python3' is not on PATH" in proc.stderr


def test_with_the_engine_installed_the_launch_names_the_hf_id(tmp_path: Path) -> None:
    pkg = tmp_path / "site" / "vllm_mindspore"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    env = _path_with_python(tmp_path)
    env["PYTHONPATH"] = str(tmp_path / "site")
    proc = invoke(*REAL, "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "--model Qwen/Qwen3-8B" in proc.stdout
