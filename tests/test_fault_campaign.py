"""scripts/fault_campaign.py stays runnable: a few of its cases, end to end, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fault_campaign.py"


def test_the_campaign_lists_every_case() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    names = proc.stdout.splitlines()
    assert len(names) >= 20
    assert "server dies on probe" in names


@pytest.mark.slow
def test_a_few_cases_pass_and_the_verdict_is_one_line_each() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "headroom nan,block size 7,server dies on probe"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert len(lines) == 3
    assert all(ln.startswith("PASS") for ln in lines)
    assert "3 passed, 0 failed" in proc.stdout
