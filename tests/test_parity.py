"""Capabilities of the pipeline, the same on every engine (ARCHITECTURE.md rule 1): a busy
card, a `--serve-cmd` wrapper, the dry run, the block size, Ctrl-C and --resume. One scenario table, run over the r0.1 engine and
every V1 engine, all on the emulated card (no stack installed here); vLLM on CPU runs the same
scenarios for real in the engine tier (tests/test_vllm_cpu.py)."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cli_env, default_sigint, invoke, processes_holding, run_cli, wait_for

# 64 sequences: these tests are about the pipeline, not the width, and a 1,024-wide burst
# costs seconds a run.
NARROW = ("--max-num-seqs", "64")
# engine -> (its emulated card's --card, the emulated server a wrapper hands over to)
ENGINES = {
    "vllm-mindspore-r01": (64, ["launch", "vllm.entrypoints.openai.api_server"]),
    "vllm": (80, ["vllm", "serve"]),
    "vllm-ascend": (80, ["vllm", "serve"]),
    "vllm-mindspore": (80, ["vllm", "serve"]),
}
TENANT_PID = 4242  # the pid the emulated tools show for PRETUNER_SIM_OCCUPIED_MIB


def wrapper(tmp_path: Path, engine: str) -> tuple[str, Path]:
    """A user's own start command: records its argv, then hands over to the emulated server."""
    seen = tmp_path / "wrapper-argv.jsonl"
    script = tmp_path / "my-serve.py"
    script.write_text(
        "import json, os, sys\n"
        f"with open({str(seen)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"os.execv(sys.executable, [sys.executable, '-m', 'pretuner.sim', "
        f"*{ENGINES[engine][1]!r}, *sys.argv[1:]])\n", encoding="utf-8")
    return shlex.join([sys.executable, str(script)]), seen


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dry_run_shows_the_serve_cmd_as_the_first_launch(tmp_path: Path, engine: str) -> None:
    cmd, _ = wrapper(tmp_path, engine)
    proc = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--dry-run", "--json",
                  "--serve-cmd", cmd)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["simulated"] is True
    assert shown["first_launch"]["argv"][:2] == shlex.split(cmd)
    assert not (tmp_path / "wrapper-argv.jsonl").exists()  # a dry run launches nothing


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_busy_card_is_refused_with_its_holder(tmp_path: Path, engine: str) -> None:
    card, _ = ENGINES[engine]
    # What another tenant holds: more than an idle card's driver takes, less than the card.
    env = cli_env(PRETUNER_SIM_OCCUPIED_MIB=str(card * 1024 * 5 // 8))
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--card", str(card),
                   "--out", str(tmp_path / "r"), env=env, timeout=120)
    assert proc.returncode == 8, proc.stderr  # busy, not "does not fit" (4)
    assert "busy" in proc.stderr
    assert f"pid {TENANT_PID}" in proc.stderr
    assert "nothing was concluded about the model" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_the_serve_cmd_is_launched_and_deployed(tmp_path: Path, engine: str) -> None:
    card, _ = ENGINES[engine]
    cmd, seen = wrapper(tmp_path, engine)
    run = tmp_path / "r"
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--card", str(card),
                   "--serve-cmd", cmd, "--max-model-len", "4096", "--min-model-len", "4096",
                   *NARROW, "--out", str(run), env=cli_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    launches = [json.loads(line) for line in seen.read_text(encoding="utf-8").splitlines()]
    assert len(launches) == len(list(run.glob("launch-*")))  # every launch went through it
    assert all("qwen3-8b" in argv for argv in launches)
    assert cmd in (run / "serve.sh").read_text(encoding="utf-8")  # production starts it too


@pytest.mark.parametrize(("engine", "given", "launched"), [
    ("vllm-ascend", "16", 16),  # given, though it is vLLM's default: kept
    ("vllm-ascend", None, 128),  # not given: the engine's own
    ("vllm", None, 16),
    ("vllm", "32", 32),
    ("vllm-mindspore-r01", None, 16),
])
def test_a_block_size_given_is_kept_and_one_not_given_is_the_engines(
        engine: str, given: str | None, launched: int) -> None:
    flags = ["--block-size", given] if given else []
    proc = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--dry-run", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout)["first_launch"]
    assert first["settings"]["block_size"] == launched
    argv = first["argv"]
    shown = int(argv[argv.index("--block-size") + 1]) if "--block-size" in argv else None
    assert shown in (launched, None if given is None else launched)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_ctrl_c_while_the_server_loads_then_resume(tmp_path: Path, engine: str) -> None:
    card, _ = ENGINES[engine]
    out = tmp_path / "r"
    env = cli_env(PRETUNER_SIM_STARTUP_S="1.5")  # a server that takes a moment to load
    argv = [sys.executable, "-m", "pretuner", "run", "--model", "qwen3-8b", "--engine", engine, "--emulate",
            "--card", str(card), "--max-model-len", "4096", "--min-model-len", "4096",
            *NARROW, "--out", str(out)]
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as err:
        run = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                               stdin=subprocess.DEVNULL, preexec_fn=default_sigint)
        try:
            wait_for(stderr_path, " loading ")
            run.send_signal(signal.SIGINT)
            code = run.wait(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
    said = stderr_path.read_text(encoding="utf-8")
    assert code == 130, said
    assert said.strip().splitlines()[-1] == (
        f"pretuner: interrupted; resume with: pretuner run --resume {out}")
    for log in out.glob("launch-*/server.log"):
        assert processes_holding(log) == [], f"a server of {log} survived pretuner"
    resumed = run_cli("run", "--resume", str(out), "--json", env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["validated"] is True


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_dry_run_never_shows_a_secret(engine: str, as_json: bool) -> None:
    proc = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--dry-run",
                  *(["--json"] if as_json else []),
                  "--serve-cmd", "my-serve --api-key s3cret-value")
    assert proc.returncode == 0, proc.stderr
    assert "s3cret-value" not in proc.stdout + proc.stderr
    assert "<redacted>" in proc.stdout
