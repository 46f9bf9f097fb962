"""Provenance on every engine: a figure the emulator produced says "simulated" in the three
places a person reads it (the run's summary, report.md's "how" column, report.html's legend),
on r0.1 and on V1 alike; never "measured"."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.helpers import V1_QWEN_80_8K, FinishedRun

pytestmark = pytest.mark.slow

# Each method's canonical emulated run, printing its text summary (no --json).
RUNS = {
    "r01": ("--model", "qwen3-8b", "--card", "64"),
    "v1": V1_QWEN_80_8K,
}
# "measured" as a provenance; "not measured" (the banner) and "to be measured there" (the
# real engine's command) say the opposite.
MEASURED = re.compile(r"(?<!not )(?<!be )\bmeasured\b")


def _run(finished_run: Callable[..., FinishedRun], name: str) -> FinishedRun:
    run = finished_run(*RUNS[name])
    assert run.proc.returncode == 0, run.proc.stderr
    return run


@pytest.mark.parametrize("name", RUNS)
def test_the_summary_says_simulated(finished_run: Callable[..., FinishedRun], name: str) -> None:
    out = _run(finished_run, name).proc.stdout
    assert "(simulated)" in out
    assert not MEASURED.findall(out), out


@pytest.mark.parametrize("name", RUNS)
def test_report_md_how_column_says_simulated(
    finished_run: Callable[..., FinishedRun], name: str
) -> None:
    md = (_run(finished_run, name).folder / "report.md").read_text()
    how = [row.rsplit("|", 2)[-2].strip() for row in md.splitlines()
           if row.startswith("| ") and row.count("|") == 4]
    assert any("simulated" in cell for cell in how), how
    assert not [cell for cell in how if MEASURED.search(cell)], how
    assert not MEASURED.findall(md)


@pytest.mark.parametrize("name", RUNS)
def test_report_html_legend_says_simulated(
    finished_run: Callable[..., FinishedRun], name: str
) -> None:
    html = (_run(finished_run, name).folder / "report.html").read_text()
    legend = re.findall(r"GiB = [\d,.]+ MiB \(([^)]*)\)", html)
    assert legend
    assert any("simulated" in how for how in legend), legend
    assert not [how for how in legend if MEASURED.search(how)], legend
