"""scripts/bench_vl.py stays runnable: one seed of the 32B setting, scored as in docs/benchmarks."""

from __future__ import annotations

import re

import pytest

from tests.helpers import load_script

bench = load_script("bench_vl")


def test_options() -> None:
    args = bench.parse_args([])
    assert (args.seeds, args.soak, args.models) == (5, 200, "8B,32B")
    with pytest.raises(SystemExit):
        bench.parse_args(["--soak", "1"])


@pytest.mark.slow
def test_one_seed_meets_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--seeds", "1", "--models", "32B"]) == 0
    out = capsys.readouterr().out
    assert "OOM over the 3x soak: 0 of 1 (target 0)" in out
    m = re.search(r"tuned/truth: median ([\d.]+)", out)
    assert m is not None
    assert float(m.group(1)) >= 0.95
    assert "hand-chosen util 0.95: OOM under the load in 1" in out
