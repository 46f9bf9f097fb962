"""Secrets on the server command line and hostile run folder names (issue 14, items 1 and 8).

Fast: the redaction rule, the journal, and scripts rendered and run with a stub server.
Slow: real `pretuner run`s on the emulated card, checked in every place a command is kept.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pretuner.deploy.context import ScriptOptions
from pretuner.deploy.render import render_scripts, run_scripts
from pretuner.deploy.targets import Target
from pretuner.engines.base import LaunchCommand
from pretuner.errors import BadInputError
from pretuner.presets.model import get_preset
from pretuner.redact import (
    REDACTED,
    is_secret_name,
    redact_argv,
    redact_command_text,
    restore_command_text,
)
from pretuner.report.records import RunReport, read_report
from pretuner.tune.record import RunRecord
from tests.helpers import cli_env, invoke, run_cli

GOLDEN = Path(__file__).parent / "golden"
KEY, TOKEN = "SEKRIT-api-1", "SEKRIT-hf-2"
# Records its argv, then is the emulated server (or, with STUB_ONLY, stops there).
STUB = """\
import json, os, sys
with open(os.environ["STUB_ARGV_LOG"], "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("STUB_ONLY"):
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-m", "pretuner.sim", "serve", *sys.argv[1:]])
"""


def _assert_clean(text: str, where: str = "") -> None:
    assert KEY not in text, where
    assert TOKEN not in text, where


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api-key", True), ("hf-token", True), ("token", True), ("HF_TOKEN", True),
        ("OPENAI_API_KEY", True), ("apikey", True), ("password", True), ("client_secret", True),
        ("AWS_SECRET_ACCESS_KEY", True), ("max-num-batched-tokens", False),
        ("tokenizer", False), ("ssl-keyfile", False), ("model", False), ("MAX_TOKENS", False),
        ("prompt_token_ids", False), ("token_budgets", False), ("HF_TOKEN_PATH", False),
        ("kv_bytes_per_token", False), ("eos_token", False), ("sort_keys", False),
    ],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_redact_argv_every_form() -> None:
    argv = ["srv", "--api-key", "K", "--hf-token=T", "HF_TOKEN=x", "--token", "--port", "8",
            "--max-num-batched-tokens", "8192", "--tokenizer", "tok"]  # fmt: skip
    assert redact_argv(argv) == [
        "srv", "--api-key", REDACTED, f"--hf-token={REDACTED}", f"HF_TOKEN={REDACTED}", "--token",
        "--port", "8", "--max-num-batched-tokens", "8192", "--tokenizer", "tok",
    ]  # fmt: skip
    # an unbalanced quote still hides the value
    assert "K" not in redact_command_text("srv --api-key 'K")
    shown = LaunchCommand(argv=[*argv, "--api-key", KEY], env={"HF_TOKEN": TOKEN, "GLOG_v": "1"})
    _assert_clean(shown.shell_line())
    assert "GLOG_v=1" in shown.shell_line()


def test_restore_reads_the_variable_or_refuses() -> None:
    text = redact_command_text("srv --api-key K --hf-token=T")
    env = {"PRETUNER_SERVE_API_KEY": "K2", "PRETUNER_SERVE_HF_TOKEN": "T2"}
    assert shlex.split(restore_command_text(text, env, "r1")) == [
        "srv", "--api-key", "K2", "--hf-token=T2",
    ]  # fmt: skip
    with pytest.raises(BadInputError, match="export PRETUNER_SERVE_API_KEY"):
        restore_command_text(text, {}, "r1")


def test_journal_keeps_no_secret_and_reads_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = RunRecord(path=tmp_path)
    record.append("run_started", options={"serve_cmd": f"srv --api-key {KEY}", "sim_env": {}})
    assert KEY not in (tmp_path / "journal.jsonl").read_text()
    assert KEY not in json.dumps(record.events)
    monkeypatch.setenv("PRETUNER_SERVE_API_KEY", "from-env")
    started = next(RunRecord.open(tmp_path).of_kind("run_started"))
    assert started["options"]["serve_cmd"] == "srv --api-key from-env"
    monkeypatch.delenv("PRETUNER_SERVE_API_KEY")
    with pytest.raises(BadInputError, match="PRETUNER_SERVE_API_KEY"):
        RunRecord.open(tmp_path)


def _stub(tmp_path: Path) -> Path:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    return stub


def _bash(script: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "STUB_ONLY": "1", "STUB_ARGV_LOG": str(tmp_path / "argv.log"), **env}
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=full, check=False
    )


def test_scripts_read_secrets_from_the_environment(tmp_path: Path) -> None:
    stub = _stub(tmp_path)
    opts = ScriptOptions(
        engine_version="0.5",
        command=(sys.executable, str(stub), "--api-key", KEY, f"--hf-token={TOKEN}"),
        extra_env={"HF_TOKEN": TOKEN},
    )
    files = render_scripts(get_preset("qwen3-8b-tp2-20g-vllm"), opts, [Target.ALL])
    for name, text in files.items():
        _assert_clean(text, name)
    assert "${PRETUNER_SERVE_API_KEY}" in files["pretuner-serve.service"]
    assert "HF_TOKEN=" not in files["tuned.env"]
    assert "export PRETUNER_SERVE_API_KEY before starting" in files["tuned.env"]
    script = tmp_path / "serve.sh"
    script.write_text(files["serve.sh"])
    subprocess.run(["bash", "-n", str(script)], check=True)
    missing = _bash(script, tmp_path)
    assert missing.returncode != 0
    assert "export PRETUNER_SERVE_API_KEY" in missing.stderr
    assert not (tmp_path / "argv.log").exists()
    env = {"PRETUNER_SERVE_API_KEY": "k 1", "PRETUNER_SERVE_HF_TOKEN": "t$2", "HF_TOKEN": "h"}
    assert _bash(script, tmp_path, **env).returncode == 0
    argv = json.loads((tmp_path / "argv.log").read_text())
    assert argv[:3] == ["--api-key", "k 1", "--hf-token=t$2"]


EVIL_ID = "r\ntouch pwned\nx"


def test_run_id_with_a_newline_is_one_comment(tmp_path: Path) -> None:
    golden = read_report(GOLDEN / "run")  # an r0.1 report.json of schema 1: it still reads
    assert isinstance(golden, RunReport)
    record = golden.model_copy(update={"run_id": EVIL_ID, "final": golden.final.model_copy(
        update={"serve_command": [sys.executable, str(_stub(tmp_path)), *golden.final.flags]})})
    files = run_scripts(record, ScriptOptions(), [Target.ALL])
    for name, text in (("serve.sh", files["serve.sh"]), ("tuned.env", files["tuned.env"])):
        assert "\ntouch pwned" not in text
        assert "# run r?touch pwned?x: " in text
        script = tmp_path / name
        script.write_text(text)
        subprocess.run(["bash", "-n", str(script)], check=True)
    assert _bash(tmp_path / "serve.sh", tmp_path).returncode == 0
    subprocess.run(["bash", "-c", "set -a; . ./tuned.env"], cwd=tmp_path, check=True)
    assert (tmp_path / "argv.log").exists()  # serve.sh ran to its exec
    assert not (tmp_path / "pwned").exists()


def test_out_with_a_newline_is_bad_input(tmp_path: Path) -> None:
    out = tmp_path / EVIL_ID
    proc = invoke("run", "--model", "qwen3-8b", "--card", "64", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "control character" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # the error and its hint
    assert not out.exists()
    assert not list(tmp_path.rglob("pwned"))


def _files_text(folder: Path) -> str:
    return "".join(
        p.read_text(errors="replace")
        for p in folder.rglob("*")
        if p.is_file()  # server.log too: the server logs its own --api-key, scrubbed at the end
    )


@pytest.mark.slow
def test_run_stores_no_secret_anywhere(tmp_path: Path) -> None:
    stub = _stub(tmp_path)
    serve_cmd = shlex.join([sys.executable, str(stub), "--api-key", KEY, f"--hf-token={TOKEN}"])
    out = tmp_path / "run"
    env = cli_env(STUB_ARGV_LOG=str(tmp_path / "launched.log"))
    args = ["run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd", serve_cmd]
    dry = invoke(*args, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    _assert_clean(dry.stdout)
    assert "--api-key '<redacted>'" in dry.stdout
    proc = run_cli("--debug", *args, "--out", str(out), "--json", env=env)  # logs the command
    assert proc.returncode == 0, proc.stderr
    _assert_clean(proc.stdout + proc.stderr)
    _assert_clean(_files_text(out))
    # the server itself got the secret
    assert [KEY in line for line in (tmp_path / "launched.log").read_text().splitlines()] == [
        True, True,
    ]  # fmt: skip
    started = json.loads((out / "journal.jsonl").read_text().splitlines()[0])
    assert "--api-key '<redacted>'" in started["options"]["serve_cmd"]
    cmd = json.loads((out / "launch-1" / "command.json").read_text())
    assert REDACTED in cmd["argv"]
    assert "--api-key '<redacted>'" in cmd["shell"]
    rep = json.loads((out / "report.json").read_text())
    assert f"--hf-token={REDACTED}" in rep["final"]["serve_command"]
    assert json.loads(proc.stdout) == rep
    # serve.sh works once the operator exports the variables it names
    env_ok = {"PRETUNER_SERVE_API_KEY": KEY, "PRETUNER_SERVE_HF_TOKEN": TOKEN}
    # no npu-smi here to show the card the proof ran on: serve.sh's guard is skipped
    assert _bash(out / "serve.sh", tmp_path, PRETUNER_SKIP_GUARD="1", **env_ok).returncode == 0
    assert KEY in (tmp_path / "argv.log").read_text()

    # --resume of a run the journal knows only redacted: the secret comes from the variable.
    again = tmp_path / "again"
    again.mkdir()
    (again / "journal.jsonl").write_text((out / "journal.jsonl").read_text().splitlines()[0] + "\n")
    refused = invoke("run", "--resume", str(again), env=env)
    assert refused.returncode == 2, refused.stderr
    assert "export PRETUNER_SERVE_API_KEY" in refused.stderr
    resumed = run_cli("run", "--resume", str(again), "--json", env={**env, **env_ok})
    assert resumed.returncode == 0, resumed.stderr
    assert KEY not in _files_text(again)
