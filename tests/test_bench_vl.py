"""scripts/bench_vl.py stays runnable: one seed of the 32B setting, scored as the README's."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_vl.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vl", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_options() -> None:
    args = bench.parse_args([])
    assert (args.seeds, args.soak, args.models) == (5, 200, "8B,32B")
    with pytest.raises(SystemExit):
        bench.parse_args(["--soak", "1"])


def test_one_seed_meets_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--seeds", "1", "--models", "32B"]) == 0
    out = capsys.readouterr().out
    assert "OOM over the 3x soak: 0 of 1 (target 0)" in out
    m = re.search(r"tuned/truth: median ([\d.]+)", out)
    assert m is not None
    assert float(m.group(1)) >= 0.95
    assert "hand-chosen util 0.95: OOM under the load in 1" in out
