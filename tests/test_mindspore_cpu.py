"""The mindspore-cpu backend: real MindSpore on CPU in the loop.

The end-to-end runs need the `mindspore` extra; they are marked so a developer can skip them
(`-m 'not mindspore'`); CI installs the extra and runs them. The fixture tests read logs that
those runs produced (trimmed with scripts/make_log_fixtures.py --from-run) and need nothing.
"""

from __future__ import annotations

import importlib.metadata
import io
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pretuner.kvmath import kv_bytes_per_token
from pretuner.logscan import scan_paths
from pretuner.logscan.events import OomKind
from pretuner.models import resolve
from pretuner.sim.engine import Request
from pretuner.sim.logs import VllmLog
from pretuner.sim.mindspore_cpu.dims import Dims
from pretuner.sim.scheduler import SchedulerLimits
from tests.helpers import cli_env, require, run_cli

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
TINY = ("tiny-llama", "tiny-mla")


@pytest.mark.parametrize("name", TINY)
def test_reference_models_match_the_network(name: str) -> None:
    spec = resolve(name)
    dims = Dims.of(spec)
    assert spec.total_params == dims.param_count()
    assert spec.weights_format(None).total_bytes == 4 * dims.param_count()
    # The KV math of the registry is what the network's cache really holds per token.
    assert kv_bytes_per_token(spec) == dims.kv_bytes_per_token()


def test_fixture_prerun_dump_is_read() -> None:
    scan = scan_paths([FIXTURES / "mscpu-ok-launch-1.log"])
    assert scan.worst is not None
    assert scan.worst.actual_peak_mib is not None
    assert not scan.oom
    # Weights (11.5 MiB) + the 0.8 GiB KV cache of card 2 / model-use 1 are in the peak.
    assert 819 + 11 < scan.worst.actual_peak_mib < 1843


def test_fixture_oom_at_warmup_is_an_oom() -> None:
    scan = scan_paths([FIXTURES / "mscpu-fallback-launch-1.log"])
    assert [o.event.kind for o in scan.oom][:1] == [OomKind.DEVICE_OOM]
    assert "Memory not enough" in scan.oom[0].text


class _Net:
    """The network as the engine steps it: one new token per sequence of a forward."""

    def __init__(self) -> None:
        self.d = SimpleNamespace(vocab=1000)
        self.produced: list[int] = []
        self._next = itertools.count(1)

    def forward(self, seqs: list[Any]) -> list[int]:
        out = [next(self._next) for _ in seqs]
        self.produced += out
        return out


@pytest.mark.mindspore
def test_chunked_prefill_steps_give_each_request_its_tokens() -> None:
    # With chunked prefill a step mixes decodes with prompt chunks, and only a prompt's last
    # chunk samples: every request gets exactly max_tokens tokens, each one the network made.
    require("mindspore", "PRETUNER_MINDSPORE_REQUIRED")
    from pretuner.sim.mindspore_cpu.engine import MsEngine

    net = _Net()
    limits = SchedulerLimits(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
                             block_size=4, num_blocks=64, chunked_prefill=True)
    engine = MsEngine(net, limits, VllmLog(io.StringIO()), pytest.fail)  # type: ignore[arg-type]
    reqs = [Request(f"cmpl-{i}", 20, 5) for i in range(3)]
    engine.start()
    try:
        for req in reqs:
            engine.submit(req)
        assert all(req.done.wait(30) for req in reqs)
    finally:
        engine.stop()
    assert [len(req.output) for req in reqs] == [5, 5, 5]
    assert all(req.error is None for req in reqs)
    tokens = [t for req in reqs for t in req.output]
    assert len(set(tokens)) == len(tokens)
    assert set(tokens) <= set(net.produced)


@pytest.fixture(scope="module")
def fallback_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], Path]:
    """One real run (about four minutes on 2 cores, others running): 4,096 tokens do not fit a
    2 GiB card, MindSpore's own pool refuses, the loop shortens and proves a shorter length
    under load. `--util 0.7` halves the KV cache, hence the proof's load on the CPU (r0.1 has
    no max-num-seqs of its own to cap it)."""
    require("mindspore", "PRETUNER_MINDSPORE_REQUIRED")
    out = tmp_path_factory.mktemp("mindspore") / "run"
    proc = run_cli(
        "run", "--engine", "mindspore-cpu", "--model", "tiny-llama", "--card", "2",
        "--max-model-len", "4096", "--util", "0.7", "--out", str(out),
        env=cli_env(), timeout=900,
    )
    assert proc.returncode == 9, proc.stderr[-3000:]  # validated, but shorter than asked
    return json.loads((out / "report.json").read_text("utf-8")), out


@pytest.mark.engine
@pytest.mark.mindspore
@pytest.mark.slow
def test_run_falls_back_on_real_oom_then_validates_on_real_mindspore(
        fallback_run: tuple[dict[str, object], Path]) -> None:
    report, out = fallback_run
    assert report["validated"] is True
    ran = [d for d in sorted(out.glob("launch-*"))
           if "actual peak used mem:" in (d / "server.log").read_text("utf-8", errors="replace")]
    assert ran  # MindSpore's own dump, at teardown of a launch whose probe ran
    scan = json.loads((ran[0] / "scan.json").read_text("utf-8"))
    assert scan["worst_actual_peak_mib"] > 819  # the KV cache is in the pool
    env = (out / "tuned.env").read_text("utf-8")
    assert "ASCEND_TOTAL_MEMORY_GB=2" in env
    assert "vLLM_MODEL_MEMORY_USE_GB=" in env
    # The same run fell back on a real OOM first (one test: xdist's groups did not keep two
    # tests of this module on one worker, and each worker ran the 4-minute run again).
    first = (out / "launch-1" / "server.log").read_text("utf-8", errors="replace")
    assert "Memory not enough" in first  # MindSpore's pool refused, not the emulator
    journal = (out / "journal.jsonl").read_text("utf-8")
    assert "shorten max_model_len" in journal
    final = report["final"]
    assert isinstance(final, dict)
    assert final["max_model_len"] < 4096
    assert report["given_up"] == [f"max_model_len {final['max_model_len']:,} < 4,096 asked"]
    # The proof's fingerprint: the MindSpore it ran on (as pip installed it), and MindSpore's
    # graph cache, not enabled here: every launch compiled, as production will (issue 29)
    stack = report["stack"]
    assert isinstance(stack, dict)
    assert stack["mindspore"] == importlib.metadata.version("mindspore")
    steps = report["steps"]
    assert isinstance(steps, list)
    assert {s["compile_cache"] for s in steps} == {"off"}
