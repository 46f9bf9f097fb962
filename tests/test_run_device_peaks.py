"""`pretuner run` on the emulated card samples its memory during every launch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pretuner.engines.outcome import LaunchOutcome
from pretuner.report.records import R01Derivation
from tests.helpers import R01_QWEN_64, FinishedRun, cli_env, run_cli

pytestmark = pytest.mark.slow

PHASES = {"launch", "loading", "ready", "probe", "load", "burst", "stop"}


def test_report_steps_carry_device_peaks(finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*R01_QWEN_64)
    proc, out = run.proc, run.folder
    assert proc.returncode == 0, proc.stderr
    assert "no device memory reader" not in proc.stderr
    rep = json.loads((out / "report.json").read_text())
    card_mib = 64 * 1024
    for step in rep["steps"]:
        assert step["device_reader"] == "emulated"
        peaks = step["device_peaks_mib"]
        assert {"loading", "stop"} <= set(peaks) <= PHASES, peaks
        assert all(0 < mib <= card_mib for mib in peaks.values()), peaks
    # The server's pool is on the card once it is ready: above what it held while starting.
    validate = rep["steps"][-1]["device_peaks_mib"]
    assert max(validate.values()) > validate.get("launch", 0)
    # What the device held beyond the pool and what was in use at MindSpore's init is the
    # reserve: nothing on the emulated card, whose CANN share comes before that reading.
    assert "0 MiB the device held outside the pool, simulated, + 8 MiB margin" in (
        rep["derivation"]["final_util_source"])
    md = (out / "report.md").read_text()
    assert "| outside the pool after init (device peak - that - pool cap) | 0.00 |" in md
    assert "| in use before the pool (device total - free at MindSpore's init) |" in md
    journal = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    launches = [LaunchOutcome.from_json(e["outcome"]) for e in journal if e["event"] == "launch"]
    assert [o.device_peaks_mib for o in launches] == [s["device_peaks_mib"] for s in rep["steps"]]
    # A journal written before the sampler existed still resumes.
    old = {k: v for k, v in launches[0].to_json().items() if not k.startswith("device_")}
    assert LaunchOutcome.from_json(old).device_peaks_mib == {}
    assert LaunchOutcome.from_json(old).device_reader is None



def test_a_pool_that_grows_on_demand_is_not_told_apart_from_what_lies_outside(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--out", str(out),
                   env=cli_env(MS_ALLOC_CONF="enable_vmm:true"))
    assert proc.returncode == 0, proc.stderr
    rep = json.loads((out / "report.json").read_text())
    assert "256 MiB reserve (scaled to the card: MindSpore maps its pool as it grows" in (
        rep["derivation"]["final_util_source"])
    assert "| outside the pool | - | not told apart" in (out / "report.md").read_text()


def test_without_a_reader_the_run_says_so_once(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from pretuner.tune import entry
    from pretuner.tune.r01 import setup as r01setup

    for key, value in cli_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(r01setup, "select_reader", lambda kind, env, count=1: None)
    said: list[tuple[str, str]] = []
    opts = entry.RunOptions(model="qwen3-8b", card_gib=64, engine="sim",
                            out=str(tmp_path / "run"))
    outcome = entry.run_tuning(opts, lambda name, detail: said.append((name, detail)))
    assert isinstance(outcome, entry.RunOutcome)  # no --engine: the r0.1 method
    assert said.count(("device", r01setup.NO_READER)) == 1
    steps = outcome.report.steps
    assert len(steps) >= 2
    assert all(s.device_reader is None and s.device_peaks_mib == {} for s in steps)
    d = outcome.report.derivation
    assert isinstance(d, R01Derivation)
    assert "no device reading of memory outside the pool" in d.final_util_source
