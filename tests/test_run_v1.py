"""`pretuner run --engine vllm` end to end on the emulated H100: real server processes, real
HTTP, the emulated NVML sampled in the background, and the files a user starts production with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from pretuner.sim.executor import tune_v1_in_process
from pretuner.tune.entry import RunOptions
from pretuner.units import GIB
from tests.helpers import (
    CONFIGS,
    FAST_SIM,
    V1_QWEN_80_8K,
    V1_QWEN_80_32K,
    WIDE_DEFAULT,
    FinishedRun,
    cli_env,
    invoke,
    run_cli,
    shared,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


UTIL_090_TOKENS = json.loads(shared("real-logs", "vllm-0.24-h100", "A2-util090.json").read_text())[
    "kv_tokens"]


@pytest.mark.slow
def test_run_pins_kv_on_the_emulated_h100_and_proves_it(
        finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*V1_QWEN_80_32K)
    proc, out = run.proc, run.folder
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["validated"]
    assert rep["simulated"]
    assert rep["engine"] == "vllm"
    assert rep["launches"] <= 3
    kv = rep["derivation"]["kv_cache_memory_bytes"]
    # The real card: 60 GiB served the max-length load, 61 GiB dies at start-up; the proof's
    # 1024-wide short burst needs about 1.1 GiB more beside the KV (emulated: test_burst.py).
    assert 58 * GIB <= kv < 60 * GIB
    assert rep["final"]["kv_tokens"] >= 1.06 * UTIL_090_TOKENS
    assert rep["derivation"]["baseline"]["kv_tokens"] is not None
    for step in rep["steps"]:  # every launch carries its sampled peaks
        assert step["device_reader"] == "emulated", step
        assert step["device_peaks_mib"], step
    d = rep["derivation"]["budget"]
    # the printed arithmetic adds up (figures rounded to 0.1 MiB, the result floored to a MiB)
    assert d["non_kv_peak_mib"] == pytest.approx(d["device_peak_mib"] - d["held_kv_mib"], abs=0.1)
    assert 0 <= d["device_total_mib"] - d["non_kv_peak_mib"] - d["margin_mib"] - d[
        "pinned_kv_mib"] < 1.1
    assert kv == d["pinned_kv_mib"] * 2**20 or rep["launches"] == 3  # a back-off moves it
    serve = (out / "serve.sh").read_text()
    assert f"--kv-cache-memory-bytes {kv}" in serve
    assert "ASCEND_TOTAL_MEMORY_GB" not in serve
    assert "vLLM_MODEL_MEMORY_USE_GB" not in serve
    unit = (out / "pretuner-serve.service").read_text()
    assert "EnvironmentFile=/etc/pretuner/tuned.env" in unit
    assert f"--kv-cache-memory-bytes {kv}" in unit
    assert "vLLM_MODEL_MEMORY_USE_GB" not in unit
    config = (out / "vllm-config.yaml").read_text()
    assert f"kv-cache-memory-bytes: {kv}" in config  # vLLM's --config takes the CLI spelling
    # No --max-num-seqs given: proven at vLLM's own default on an H100 (1024, not 256) and
    # written out, so production runs what was proven.
    assert rep["final"]["max_num_seqs"] == 1024
    assert "--max-num-seqs 1024 --max-num-batched-tokens 8192" in serve
    assert "max-num-seqs: 1024" in config
    md = (out / "report.md").read_text()
    assert "SIMULATED" in md
    assert "--kv-cache-memory-bytes" in md


def start_script(script: Path, port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([str(script), "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def answers(proc: subprocess.Popen[bytes], port: int, log: Path) -> dict[str, Any]:
    """The server's reply to a short completion, once /health says it is up."""
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.1)
    model = requests.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
    reply = requests.post(f"{base}/v1/completions", timeout=30,
                          json={"model": model, "prompt": [11, 12, 13], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def served_by(script: Path, env: dict[str, str], log: Path) -> tuple[int, dict[str, Any]]:
    """The port `script` was started on and its server's reply to a short completion; the
    server is stopped again."""
    port = free_port()
    server = start_script(script, port, env, log)
    try:
        return port, answers(server, port, log)
    finally:
        stop(server)


@pytest.mark.slow
def test_the_written_serve_script_starts_a_server_that_serves(
        tmp_path: Path, finished_run: Callable[..., FinishedRun]) -> None:
    """The startup script a user gets, started for real: the run folder's serve.sh (the one
    `pretuner script` writes) runs the real `vllm serve`, even after a run on the emulated
    card: a fake `vllm` on PATH records what it was given and serves it."""
    run = finished_run(*V1_QWEN_80_8K)  # serve.sh writes nothing beside itself
    out, env = run.folder, cli_env(**FAST_SIM)
    assert run.proc.returncode == 0, run.proc.stderr
    kv = run.report()["derivation"]["kv_cache_memory_bytes"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    argv_file = tmp_path / "vllm-argv.txt"
    fake.write_text("#!/usr/bin/env bash\n"
                    f"printf '%s\\n' \"$@\" > {shlex.quote(str(argv_file))}\n"
                    f"exec {shlex.quote(sys.executable)} -m pretuner.sim vllm \"$@\"\n")
    fake.chmod(0o755)
    # the device the proof ran on, as serve.sh's guard reads it: the emulated H100's nvidia-smi
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m pretuner.sim nvidia-smi \"$@\"\n")
    smi.chmod(0o755)
    env_fake = dict(env, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    port, body = served_by(out / "serve.sh", env_fake, tmp_path / "serve.log")
    assert body["usage"]["completion_tokens"] == 2
    assert f"'kv_cache_memory_bytes': {kv}" in (tmp_path / "serve.log").read_text()
    argv = argv_file.read_text().split("\n")
    assert argv[:2] == ["serve", "Qwen/Qwen3-8B"]
    flags = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert flags["--kv-cache-memory-bytes"] == str(kv)
    assert flags["--max-model-len"] == "8192"
    assert flags["--port"] == str(port)


def test_weights_that_cannot_fit_are_refused_before_any_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = invoke("run", "--model", "qwen3-32b", "--engine", "vllm", "--emulate", "--card", "24", "--tp",
                  "1", "--max-model-len", "32768", "--out", str(out), "--json",
                  env=cli_env(**FAST_SIM))
    assert proc.returncode == 4, proc.stderr
    err = json.loads(proc.stdout)
    assert err["error_type"] == "InfeasibleError"
    assert "--tp" in err["hint"]
    assert not out.exists()  # decided from the checkpoint size: no launch, no run folder


@pytest.mark.slow
def test_a_length_the_card_cannot_hold_ends_infeasible_from_a_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "24", "--tp", "1",
                   "--max-model-len", "40960", "--out", str(out), "--json",
                   env=cli_env(**FAST_SIM))
    assert proc.returncode == 4, proc.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["validated"] is False
    assert len(rep["steps"]) == 2  # measured, never predicted: util 0.9, one sequence pinned
    assert rep["steps"][1]["settings"]["kv_cache_bytes"] is not None
    assert "--max-model-len" in rep["hint"]
    assert "FAILED" in (out / "report.md").read_text()


@pytest.mark.slow
def test_in_process_and_subprocess_runs_decide_the_same(
        tmp_path: Path, finished_run: Callable[..., FinishedRun]) -> None:
    opts = RunOptions(model="qwen3-8b", engine="vllm", emulate=True, card_gib=80, max_model_len=32768)
    r = tune_v1_in_process(opts, tmp_path / "inproc")
    proc = finished_run(*V1_QWEN_80_32K).proc
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    # In process the burst's 1024 requests reach the engine at once; over HTTP they arrive
    # over a second of wall time while this emulated card's steps are scaled by 0.01
    # (FAST_SIM), so its batch is narrower and may leave up to the width's sampler rows (two
    # fp32 logits copies x 1024 rows x vocabulary) more KV; never less.
    subprocess_kv, in_process_kv = rep["derivation"]["kv_cache_memory_bytes"], r.final.kv_cache_bytes
    assert in_process_kv is not None
    assert in_process_kv * 0.99 <= subprocess_kv <= in_process_kv + 2 * 1024 * 151_936 * 4


@pytest.mark.slow
def test_a_v1_run_names_the_real_engine_command_and_becomes_a_pinned_preset(
        tmp_path: Path, finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*V1_QWEN_80_8K)
    proc, out = run.proc, run.folder
    assert proc.returncode == 0, proc.stderr
    rep = json.loads((out / "report.json").read_text())
    real = rep["final"]["engine_serve_command"]
    assert real[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert "--kv-cache-memory-bytes" in real
    assert "vllm serve Qwen/Qwen3-8B" in proc.stdout
    (tmp_path / "presets").mkdir()
    add = invoke("presets", "add", str(out), "--out", str(tmp_path / "presets"),
                 env=cli_env(**FAST_SIM))
    assert add.returncode == 0, add.stderr
    (preset,) = (tmp_path / "presets").glob("*.json")
    data = json.loads(preset.read_text())
    assert data["kv_basis"] == "pinned"
    assert data["kv_cache_memory_bytes"] == rep["derivation"]["kv_cache_memory_bytes"]
    assert "vLLM_MODEL_MEMORY_USE_GB" not in data["env"]


@pytest.mark.slow
def test_an_interrupted_v1_run_resumes_from_its_journal(tmp_path: Path) -> None:
    """A journal that stopped after its launches (as a Ctrl-C leaves it) resumes: the finished
    launches are replayed, not run again, and the result is the same."""
    out = tmp_path / "run"
    first = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                    "--max-model-len", "8192", "--out", str(out), "--json",
                    env=cli_env(**FAST_SIM))
    assert first.returncode == 0, first.stderr
    journal = out / "journal.jsonl"
    kept = [line for line in journal.read_text().splitlines()
            if '"run_finished"' not in line]
    journal.write_text("\n".join(kept) + "\n")
    for name in ("report.json", "report.md", "serve.sh", "vllm-config.yaml", "tuned.env"):
        (out / name).unlink()
    launches = sorted(p.name for p in out.glob("launch-*"))
    again = run_cli("run", "--resume", str(out), "--json", env=cli_env(**FAST_SIM))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.glob("launch-*")) == launches  # replayed, none run again
    assert f"#{len(launches)} replay " in again.stderr  # each shown by its folder's number
    assert json.loads(again.stdout)["final"] == json.loads(first.stdout)["final"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(["--engine", "vllm", "--emulate", "--card", "50"], "no 50 GB profile",
                     id="card"),
        pytest.param(["--engine", "bogus"], "choose one of: auto", id="engine"),
        pytest.param(["--engine", "vllm", "--emulate", "--backend", "sim"], "keep --engine", id="both"),
        pytest.param(["--engine", "vllm", "--emulate", "--model-use-gb", "50"], "--kv-cache-memory-bytes",
                     id="r01-variable"),
        pytest.param(["--engine", "vllm", "--emulate", "--max-num-seqs", "0"], "--max-num-seqs 0",
                     id="seqs"),
        # Below the H100's default max-num-seqs (1024): vLLM would refuse it at start-up.
        pytest.param(["--engine", "vllm", "--emulate", "--max-num-batched-tokens", "512"],
                     "--max-num-batched-tokens 512", id="batched-below-default-seqs"),
    ],
)
def test_bad_v1_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    proc = invoke("run", "--model", "qwen3-8b", *args, "--dry-run",
                  env=cli_env(**{**FAST_SIM, **WIDE_DEFAULT}))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_model_folder_given_relative_is_deployed_by_its_absolute_path(tmp_path: Path) -> None:
    # Seen on the real H200: `--model .devq/qwen3-8b` went into serve.sh as given, and
    # `./serve.sh` from the run folder (as report.md says) could not find the model.
    model = tmp_path / "models" / "qwen3-8b"
    model.mkdir(parents=True)
    (model / "config.json").write_text((CONFIGS / "Qwen--Qwen3-8B.json").read_text())
    out = tmp_path / "run"
    proc = run_cli("run", "--model", "models/qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                   "--max-model-len", "8192", "--out", str(out), "--json",
                   env=cli_env(**FAST_SIM), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert str(model) in rep["final"]["serve_command"]
    assert rep["retune_command"][3] == str(model)
    assert f" {model} " in (out / "serve.sh").read_text()
