"""`pretuner run` end to end against the emulated card: real subprocesses, HTTP, signals."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    R01_QWEN_32_CHUNKED,
    R01_QWEN_64,
    FinishedRun,
    cli_env,
    default_sigint,
    invoke,
    processes_holding,
    run_cli,
    wait_for,
)


def report(run_dir: Path) -> dict[str, Any]:
    rep: dict[str, Any] = json.loads((run_dir / "report.json").read_text())
    return rep


@pytest.mark.slow
def test_run_validates_in_two_launches(finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*R01_QWEN_64)
    proc, out = run.proc, run.folder
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep == report(out)
    # --json keeps stdout for the JSON; the progress still goes to stderr.
    assert "#1 launch  prerun" in proc.stderr
    assert "#2 load    " in proc.stderr
    # The emulated card's figures are never called measured (the banner says SIMULATED).
    assert "measured" not in proc.stderr
    assert "(simulated)" in proc.stderr
    page = (out / "report.html").read_text()  # written by the run itself
    assert "SIMULATED" in page
    assert "http://" not in page
    assert rep["engine"] == "sim"
    assert rep["simulated"] is True
    assert rep["validated"] is True
    assert rep["launches"] == 2
    steps = rep["steps"]
    assert [s["purpose"] for s in steps] == ["prerun", "validate"]
    assert steps[0]["settings"]["max_num_seqs"] == 1
    # max-num-seqs concurrent max-length requests, then the short burst as wide
    assert "#2 burst   " in proc.stderr
    assert (
        steps[1]["requests_ok"]
        == steps[1]["requests_total"]
        == 2 * rep["final"]["max_num_seqs"]
    )
    env = rep["final"]["env"]
    assert env["ASCEND_TOTAL_MEMORY_GB"] == "64"
    assert int(env["vLLM_MODEL_MEMORY_USE_GB"]) >= 1
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--gpu-memory-utilization", "--block-size", "--tensor-parallel-size"):
        assert flag in rep["final"]["flags"]
    assert rep["final"]["kv_tokens"] >= rep["final"]["max_num_seqs"] * 16384
    for name in ("tuned.env", "serve.sh", "report.md", "journal.jsonl"):
        assert (out / name).is_file()
    assert (out / "serve.sh").stat().st_mode & stat.S_IXUSR
    assert "SIMULATED" in (out / "serve.sh").read_text()
    assert (out / "launch-1" / "server.log").is_file()
    cmd = json.loads((out / "launch-1" / "command.json").read_text())
    assert cmd["env"]["GLOG_v"] == "1"
    assert "--max-num-seqs" in cmd["argv"]


@pytest.mark.slow
@pytest.mark.slow
def test_the_run_folder_holds_what_script_writes(
        finished_run: Callable[..., FinishedRun], tmp_path: Path) -> None:
    """One renderer: the run folder's startup files are `pretuner script RUN`'s, byte for byte;
    on the emulated card they start the real vLLM-MindSpore, which report.md names."""
    run = finished_run(*R01_QWEN_64)
    out = tmp_path / "files"
    assert invoke("script", str(run.folder), "--out", str(out)).returncode == 0
    for path in out.iterdir():
        assert (run.folder / path.name).read_text() == path.read_text(), path.name
    real = report(run.folder)["final"]["engine_serve_command"]
    assert real[:5] == ["python3", "-m", "vllm_mindspore.entrypoints",
                        "vllm.entrypoints.openai.api_server", "--model"]
    assert "exec python3 -m vllm_mindspore.entrypoints" in (out / "serve.sh").read_text()
    assert " ".join(real) in (run.folder / "report.md").read_text()


@pytest.mark.slow  # the README's first command: an emulated full run
def test_default_command_deepseek_v3(tmp_path: Path) -> None:
    proc = run_cli("run", "--model", "deepseek-v3", "--card", "64", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "SIMULATED" in proc.stdout
    assert "VALIDATED" in proc.stdout
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    rep = report(runs[0])
    assert (rep["tp"], rep["nodes"]) == (16, 2)
    assert len(rep["steps"][0]["rank_peaks_mib"]) == 16


@pytest.mark.slow
def test_two_runs_never_share_a_folder(tmp_path: Path) -> None:
    for _ in range(2):
        proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--no-validate", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_dry_run_launches_nothing(tmp_path: Path) -> None:
    proc = invoke("run", "--model", "qwen3-8b", "--card", "64", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "GLOG_v=1" in proc.stdout
    assert "--max-num-seqs 1" in proc.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_busy_card_lowers_util(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = cli_env(PRETUNER_SIM_PROFILE="910b-64-busy")
    proc = run_cli(
        "run", "--model", "qwen3-8b", "--card", "64", "--out", str(out), "--json", env=env
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["validated"]
    assert rep["steps"][0]["settings"]["util"] < 0.9
    assert any(d["decision"] == "lower pre-run util" for d in rep["decisions"])


@pytest.mark.slow
def test_device_refusal_is_learned_from(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = cli_env(PRETUNER_SIM_PROFILE="910b-64-busy")
    proc = run_cli(
        "run", "--model", "qwen3-8b", "--card", "64", "--reserve-gb", "0", "--out", str(out),
        "--json", env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    kinds = [s["outcome"] for s in rep["steps"]]
    assert kinds[0] == "device_memory_refused"
    assert rep["validated"]
    assert any(d["decision"] == "lower util" for d in rep["decisions"])


@pytest.mark.slow
def test_server_dies_at_start(tmp_path: Path) -> None:
    cmd = f"{sys.executable} -c 'import sys; print(\"boom\"); sys.exit(3)'"
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd", cmd,
                   "--out", str(tmp_path / "r"))  # fmt: skip
    assert proc.returncode == 5, proc.stderr
    assert re.search(r"(exited with code|exit code) 3\b", proc.stderr), proc.stderr
    assert "boom" in proc.stderr  # the log's tail
    assert "server.log" in proc.stderr


@pytest.mark.slow
def test_server_hangs(tmp_path: Path) -> None:
    cmd = f"{sys.executable} -c 'import time; time.sleep(120)'"
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd", cmd,
                   "--ready-timeout", "2", "--out", str(tmp_path / "r"))  # fmt: skip
    assert proc.returncode == 5
    assert "not ready after 2 s" in proc.stderr
    assert processes_holding(tmp_path / "r" / "launch-1" / "server.log") == []


@pytest.mark.slow
def test_server_without_dump(tmp_path: Path) -> None:
    cmd = f"env GLOG_v=3 {sys.executable} -m pretuner.sim serve"
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd", cmd,
                   "--out", str(tmp_path / "r"))  # fmt: skip
    assert proc.returncode == 5
    assert "without a memory-pool dump" in proc.stderr
    assert "GLOG_v=1" in proc.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "deepseek-v4", "--card", "64"], "did you mean deepseek-v3"),
        (["--model", "qwen3-8b", "--card", "0"], "card size 0 GiB is invalid"),
        (["--model", "qwen3-8b", "--card", "64", "--util", "1.2"], "outside (0, 1]"),
        (["--model", "qwen3-8b", "--card", "64", "--util", "0"], "outside (0, 1]"),
        (["--model", "qwen3-8b", "--card", "64", "--model-use-gb", "58"], "leaves no KV"),
        (["--model", "qwen3-8b", "--card", "64", "--out", "/proc/pretuner-run"], "cannot create"),
        (["--model", "qwen3-8b", "--card", "64", "--backend", "tpu"], "unknown backend 'tpu'"),
        (["--model", "qwen3-8b", "--card", "64", "--backend", "mindspore-cpu"], "reference models"),
    ],
)
def test_bad_input(args: list[str], fragment: str, tmp_path: Path) -> None:
    proc = invoke("run", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr


def test_out_folder_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = invoke("run", "--model", "qwen3-8b", "--card", "64", "--out", str(out))
    assert proc.returncode == 2
    assert "never overwrites" in proc.stderr
    assert (out / "notes.txt").read_text() == "mine"




@pytest.mark.slow
@pytest.mark.parametrize("phase", ["loading", "probe", "validate"])
def test_ctrl_c_leaves_no_orphan_and_resumes(tmp_path: Path, phase: str) -> None:
    out = tmp_path / "run"
    env = cli_env(PRETUNER_SIM_STARTUP_S="1.5", PRETUNER_SIM_TEARDOWN_S="0.2")
    argv = [sys.executable, "-m", "pretuner", "run", "--model", "qwen3-8b", "--card", "64",
            "--out", str(out)]  # fmt: skip
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as err:
        pt = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                              stdin=subprocess.DEVNULL, preexec_fn=default_sigint)  # fmt: skip
        try:
            marker = {"loading": " loading ", "probe": " probe ", "validate": " load "}[phase]
            wait_for(stderr_path, marker)
            pt.send_signal(signal.SIGINT)
            code = pt.wait(timeout=60)
        finally:
            if pt.poll() is None:
                pt.kill()
    assert code == 130, stderr_path.read_text()
    last = stderr_path.read_text().strip().splitlines()[-1]
    assert last == f"pretuner: interrupted; resume with: pretuner run --resume {out}"
    for log in out.glob("launch-*/server.log"):
        assert processes_holding(log) == [], f"a server of {log} survived pretuner"
    journal = (out / "journal.jsonl").read_text()
    assert "run_stopped" in journal
    assert not (out / "report.json").exists()  # no failure report: the run is resumable
    resumed = run_cli("run", "--resume", str(out), "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr
    rep = json.loads(resumed.stdout)
    assert rep["validated"]
    if phase == "validate":  # the finished pre-run is replayed, not launched again
        assert not (out / "launch-3").exists()
        assert "replay" in resumed.stderr or rep["launches"] == 2


@pytest.mark.slow
def test_serve_cmd_points_at_any_compatible_server(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = f"{sys.executable} -m pretuner.sim serve"  # the plain server, no r0.1 wrapper
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd", cmd,
                   "--out", str(out), "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["validated"]
    assert rep["launches"] == 2
    assert rep["final"]["serve_command"][:3] == [sys.executable, "-m", "pretuner.sim"]
    assert os.access(out / "serve.sh", os.X_OK)


@pytest.mark.slow
def test_whole_prompt_step_too_big_keeps_the_length_with_chunked_prefill(
        finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*R01_QWEN_32_CHUNKED)
    proc, out = run.proc, run.folder
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["validated"]
    assert rep["launches"] <= 4
    steps = rep["steps"]
    assert steps[0]["outcome"] in ("oom_in_request", "oom_at_start")
    assert not steps[0]["settings"]["chunked_prefill"]
    chunked = [s for s in steps if s["settings"]["chunked_prefill"]]
    assert chunked
    assert all(s["settings"]["max_model_len"] == 40960 for s in chunked)
    assert "prefill in chunks" in [d["decision"] for d in rep["decisions"]]
    final = rep["final"]
    assert final["max_model_len"] == 40960
    assert final["max_num_batched_tokens"] < 40960
    assert "--enable-chunked-prefill" in final["flags"]
    argv = json.loads((out / f"launch-{len(steps)}" / "command.json").read_text())["argv"]
    assert "--enable-chunked-prefill" in argv
    # serve.sh starts production with exactly the flags the validated launch ran with
    launched = argv[argv.index("--served-model-name") + 2:]
    assert final["flags"] == launched
    assert f'{" ".join(launched)} "$@"' in (out / "serve.sh").read_text()


@pytest.mark.slow
def test_length_fallback_narrows_to_the_longest_that_fits(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(
        "run", "--model", "qwen3-8b", "--card", "24", "--tp", "1", "--max-model-len", "40960",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert proc.returncode == 9, proc.stderr  # validated, but less than asked
    rep = json.loads(proc.stdout)
    assert rep["validated"]
    assert rep["launches"] <= 6
    decisions = [d["decision"] for d in rep["decisions"]]
    assert "keep max_model_len" in decisions
    final_len = rep["final"]["max_model_len"]
    assert 16384 <= final_len < 40960
    failed = [s["settings"]["max_model_len"] for s in rep["steps"] if s["outcome"] != "ok"]
    assert min(failed) > final_len
    assert rep["steps"][-1]["purpose"] == "validate"
    assert rep["steps"][-1]["settings"]["max_model_len"] == final_len
    assert rep["asked"]["max_model_len"] == 40960
    assert rep["given_up"] == [f"max_model_len {final_len:,} < 40,960 asked"]
    head = (out / "report.md").read_text().splitlines()
    assert any("validated under full load, but less than asked: max_model_len" in line
               for line in head[:12])
    assert "pretuner run --model qwen3-8b --card 24 --max-model-len 40960 --tp 1" in (
        out / "report.md").read_text()


def test_length_above_model_limit_is_refused(tmp_path: Path) -> None:
    proc = invoke("run", "--model", "qwen3-8b", "--card", "32", "--max-model-len", "65536",
                  cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "exceeds qwen3-8b's max_position_embeddings 40,960" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_in_process_card_decides_as_real_processes(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmarks and decision tests run the emulated server in process: on a busy 24 GB card
    it must decide what the real processes, HTTP and npu-smi sampler decide, reserve included."""
    from pretuner.sim import memory as mem
    from pretuner.sim.executor import tune_in_process
    from pretuner.sim.plugin import R01_CARDS
    from pretuner.tune.entry import RunOptions, run_tuning
    from pretuner.tune.r01.config import CardInfo, TuneResult

    for key, value in cli_env().items():
        monkeypatch.setenv(key, value)
    occupied = 1500
    prof = mem.PROFILES[R01_CARDS[24]]

    def opts(name: str) -> RunOptions:
        env = {"PRETUNER_SIM_OCCUPIED_MIB": str(occupied), "PRETUNER_SIM_STARTUP_S": "0.05",
               "PRETUNER_SIM_TEARDOWN_S": "0.02",
               "PRETUNER_SIM_STATE_DIR": str(tmp_path / f"card-{name}")}
        return RunOptions(model="qwen3-8b", engine="sim", card_gib=24, max_model_len=16384,
                          seed=2, sim_env=env, out=str(tmp_path / name))

    card = CardInfo(24, prof.total_mib - prof.driver_reserved_mib - occupied, "emulated npu-smi")
    inproc = tune_in_process(opts("inproc"), tmp_path / "inproc", card)
    outcome = run_tuning(opts("real"), lambda name, detail: None)
    real = outcome.result
    assert isinstance(real, TuneResult)  # no --engine: the r0.1 method

    def decided(r: TuneResult) -> tuple[object, ...]:
        f = r.derivation.final
        return (f.gpu_memory_utilization, f.vllm_model_memory_use_gb, f.max_num_seqs,
                f.max_model_len, len(r.outcomes), r.reserve_gib)

    assert decided(inproc) == decided(real)
    assert real.reserve_gib * 1024 == pytest.approx(3)  # 1/8192 of 24 GB: nothing outside
    assert all(o.device_peaks_mib for o in (*inproc.outcomes, *real.outcomes))
