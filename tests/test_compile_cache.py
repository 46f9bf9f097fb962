"""The engine's compile cache at each launch (issue 29 item 3): where vLLM keeps it, cold or
warm on real folders, fixed for every launch and production, and a cold pre-run said."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings
from pretuner.engines.outcome import LaunchOutcome
from pretuner.engines.vllm_v1 import (
    ROWS,
    V1Engine,
    compile_cache_env,
    compile_cache_state,
)
from pretuner.tune.pinned.loop import V1Tuner
from tests.test_v1_method import _cfg, scripted_card


# Rule: vLLM's cache root is VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm;
# pretuner names it only where the user did not.
@pytest.mark.parametrize(("env", "root"), [
    ({"VLLM_CACHE_ROOT": "/data/vc"}, None),
    ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/vllm"),
    ({}, str(Path.home() / ".cache" / "vllm")),
])
def test_the_cache_root_is_fixed_where_the_user_did_not(env: dict[str, str],
                                                        root: str | None) -> None:
    assert compile_cache_env(env) == ({} if root is None else {"VLLM_CACHE_ROOT": root})


def test_a_cache_is_warm_only_when_every_folder_holds_something(tmp_path: Path) -> None:
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vc")}
    assert compile_cache_state(env) == "cold"  # no folder yet
    compiled = tmp_path / "vc" / "torch_compile_cache"
    compiled.mkdir(parents=True)
    assert compile_cache_state(env) == "cold"  # an empty one
    (compiled / "hash-0").mkdir()
    assert compile_cache_state(env) == "warm"
    inductor = tmp_path / "inductor"
    inductor.mkdir()
    both = {**env, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    assert compile_cache_state(both) == "cold"  # inductor's own, still empty
    (inductor / "fxgraph").write_text("x")
    assert compile_cache_state(both) == "warm"


def test_the_emulated_engine_and_a_wrapper_have_no_cache_here() -> None:
    row = ROWS["vllm"]
    assert V1Engine(row, True).cache_state({}) == "n/a"
    assert V1Engine(row, False, serve_cmd=("docker", "run")).cache_state({}) == "n/a"


def test_a_pre_run_with_a_cold_cache_is_said() -> None:
    base = scripted_card()

    def execute(s: LaunchSettings) -> LaunchOutcome:
        return replace(base(s), compile_cache="cold")

    r = V1Tuner(_cfg(), execute, lambda phase, detail: None).run()
    assert "cold compile cache" in [d["decision"] for d in r.decisions]
    warm = V1Tuner(_cfg(), scripted_card(), lambda phase, detail: None).run()
    assert "cold compile cache" not in [d["decision"] for d in warm.decisions]
