"""The mindspore-cpu backend: real MindSpore on CPU in the loop.

The end-to-end runs need the `mindspore` extra; they are marked so a developer can skip them
(`-m 'not mindspore'`); CI installs the extra and runs them. The fixture tests read logs that
those runs produced (trimmed with scripts/make_log_fixtures.py --from-run) and need nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretuner.backends.mindspore_cpu.dims import Dims
from pretuner.kvmath import kv_bytes_per_token
from pretuner.logscan import OomKind, scan_paths
from pretuner.models import resolve
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


def _run(tmp_path: Path, *extra: str, code: int = 0) -> tuple[dict[str, object], Path]:
    out = tmp_path / "run"
    proc = run_cli(
        "run", "--backend", "mindspore-cpu", "--model", "tiny-llama", "--card", "2",
        "--out", str(out), *extra, env=cli_env(), timeout=900,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text("utf-8")), out


@pytest.mark.engine
@pytest.mark.mindspore
@pytest.mark.slow
def test_run_validates_on_real_mindspore(tmp_path: Path) -> None:
    require("mindspore", "PRETUNER_MINDSPORE_REQUIRED")
    report, out = _run(tmp_path)
    assert report["validated"] is True
    prerun = (out / "launch-1" / "server.log").read_text("utf-8", errors="replace")
    assert "actual peak used mem:" in prerun  # MindSpore's own dump, at teardown
    scan = json.loads((out / "launch-1" / "scan.json").read_text("utf-8"))
    assert scan["worst_actual_peak_mib"] > 819  # the KV cache is in the pool
    env = (out / "tuned.env").read_text("utf-8")
    assert "ASCEND_TOTAL_MEMORY_GB=2" in env
    assert "vLLM_MODEL_MEMORY_USE_GB=" in env


@pytest.mark.engine
@pytest.mark.mindspore
@pytest.mark.slow
def test_run_falls_back_on_real_oom(tmp_path: Path) -> None:
    require("mindspore", "PRETUNER_MINDSPORE_REQUIRED")
    report, out = _run(tmp_path, "--max-model-len", "4096", code=9)  # validated, but shorter
    assert report["validated"] is True
    first = (out / "launch-1" / "server.log").read_text("utf-8", errors="replace")
    assert "Memory not enough" in first  # MindSpore's pool refused, not the emulator
    journal = (out / "journal.jsonl").read_text("utf-8")
    assert "shorten max_model_len" in journal
    final = report["final"]
    assert isinstance(final, dict)
    assert final["flags"]["max_model_len"] < 4096
    assert report["given_up"] == [f"max_model_len {final['flags']['max_model_len']:,} < 4,096 asked"]
