"""vLLM's `--config` YAML as users write it: production's address, name and API key kept for
serve.sh, each launch on pretuner's own, and the key never written in clear."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from pretuner.cli.vocab import read_vllm_config
from pretuner.engines.base import LaunchSettings, Purpose, Target
from pretuner.engines.vllm_v1 import ROWS, V1Engine, parse_server_args
from pretuner.errors import ServerFailedError
from pretuner.launch import probe
from pretuner.launch.process import read_tail
from pretuner.tune.record import RunRecord
from tests.helpers import cli_env, invoke, run_cli

CANARY = "sk-CANARY-0f1e2d3c"
SERVE_YAML = f"""\
model: qwen3-8b
max-model-len: 4096
max_num_seqs: 8
host: 0.0.0.0
port: 8000
served_model_name: qwen
api-key: {CANARY}
uvicorn-log-level: warning
chat-template: "{{{{ messages }}}} it's"
"""
SETTINGS = LaunchSettings(Purpose.VALIDATE, card_gib=80, util=0.9, model_use_gib=0,
                          max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=8192,
                          block_size=16, tp=1, kv_cache_bytes=2**34)


def test_every_key_of_a_users_yaml_becomes_its_flag_with_the_value_whole(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(SERVE_YAML)
    defaults, extra = read_vllm_config(cfg)
    assert defaults == {"model": "qwen3-8b", "max_model_len": 4096, "max_num_seqs": 8}
    # A value with a space or an apostrophe reaches the server as one word, as typed.
    assert dict(parse_server_args(extra)) == {
        "--host": "0.0.0.0", "--port": "8000", "--served-model-name": "qwen",  # noqa: S104
        "--api-key": CANARY, "--uvicorn-log-level": "warning",
        "--chat-template": "{{ messages }} it's"}


def test_production_address_and_name_go_to_serve_sh_and_each_launch_serves_on_its_own() -> None:
    args = parse_server_args(["--host 0.0.0.0 --port=8000 --served_model_name qwen",
                              f"--api_key {CANARY}"])
    engine = V1Engine(ROWS["vllm"], simulated=False, server_args=args)
    cmd = engine.command(SETTINGS, Target("Qwen/Qwen3-8B", "qwen3-8b", "127.0.0.1", 43210))
    flags = dict(zip(cmd.argv[3::2], cmd.argv[4::2], strict=False))
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "43210"
    assert flags["--served-model-name"] == "qwen3-8b"
    assert cmd.argv.count("--port") == 1
    assert flags["--api-key"] == CANARY  # the launched server wants it...
    assert cmd.bearer == CANARY  # ...and pretuner's requests send it
    assert CANARY not in json.dumps(cmd.redacted().argv)
    deployed = engine.deploy(SETTINGS).argv()
    assert deployed[deployed.index("--port") + 1] == "8000"
    assert deployed[deployed.index("--host") + 1] == "0.0.0.0"  # noqa: S104
    assert deployed[deployed.index("--served-model-name") + 1] == "qwen"


@pytest.mark.parametrize("arg", ["--kv_cache_memory_bytes 2000000000",
                                 "--kv_cache_memory_bytes=2000000000", "--max_model_len 9"])
def test_a_flag_pretuner_owns_is_refused_in_its_underscore_spelling(arg: str) -> None:
    """vLLM reads `--kv_cache_memory_bytes` as `--kv-cache-memory-bytes`: smuggled past the
    check, production would get 2 GB of KV while the run proved another size."""
    proc = invoke("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                  "--server-arg", arg, "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert "pretuner sets --" in proc.stderr


def test_the_emulated_server_wants_the_api_key_on_v1_routes_and_probes_send_it(
        tmp_path: Path) -> None:
    env = cli_env(PRETUNER_SIM_STATE_DIR=str(tmp_path / "card"))
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretuner.sim", "vllm", "serve", "qwen3-8b", "--api-key",
             CANARY, "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "0"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"Starting vLLM server on (http://127\.0\.0\.1:\d+)",
                                  log.read_text(errors="replace"))):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        base = m.group(1)
        assert requests.get(f"{base}/health", timeout=5).status_code == 200  # no key needed
        with pytest.raises(ServerFailedError, match="HTTP 401: Unauthorized"):
            probe.served_models(base)
        with probe.bearer(base, CANARY):
            assert probe.served_models(base) == ["qwen3-8b"]
            done = probe.complete(base, "qwen3-8b", [1000, 1001], 2, 30.0)
        assert done.ok, done.error
        assert not probe.complete(base, "qwen3-8b", [1000, 1001], 2, 30.0).ok  # key dropped
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_run_from_a_users_yaml_proves_it_and_writes_the_key_nowhere(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(SERVE_YAML)
    out = tmp_path / "run"
    proc = run_cli("run", "--config", str(cfg), "--engine", "vllm", "--emulate", "--card", "80", "--out",
                   str(out), "--json")
    assert proc.returncode == 0, proc.stderr  # the emulated server wanted the key: probes sent it
    assert CANARY not in proc.stdout + proc.stderr
    for path in (p for p in out.rglob("*") if p.is_file()):
        assert CANARY not in path.read_text(errors="replace"), path
    for n in (1, 2):  # each launch served on pretuner's port and name
        argv = json.loads((out / f"launch-{n}" / "command.json").read_text())["argv"]
        assert argv[argv.index("--served-model-name") + 1] == "qwen3-8b"
        assert argv[argv.index("--port") + 1] != "8000"
    serve = shlex.split((out / "serve.sh").read_text().splitlines()[-1])
    assert serve[:3] == ["exec", "vllm", "serve"]
    flags = dict(zip(serve[4::2], serve[5::2], strict=False))
    assert flags["--port"] == "8000"
    assert flags["--host"] == "0.0.0.0"  # noqa: S104
    assert flags["--served-model-name"] == "qwen"
    assert flags["--api-key"] == "$PRETUNER_SERVE_API_KEY"
    assert flags["--chat-template"] == "{{ messages }} it's"
    config = (out / "vllm-config.yaml").read_text()
    assert "port: 8000" in config
    assert "api-key" not in config.replace("secret --api-key", "")
    # A record written before runs redacted the key: the preset made from it has none either.
    report = out / "report.json"
    report.write_text(report.read_text().replace("<redacted>", CANARY))
    presets = tmp_path / "presets"
    presets.mkdir()
    added = invoke("presets", "add", str(out), "--out", str(presets))
    assert added.returncode == 0, added.stderr
    assert CANARY not in "".join(p.read_text() for p in presets.iterdir())


@pytest.mark.slow
def test_a_run_sends_the_key_the_engine_reads_from_its_environment(tmp_path: Path) -> None:
    """vLLM takes VLLM_API_KEY when no --api-key is given: a user who exported it gets a
    server that wants it from pretuner's requests too."""
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                   "--max-model-len", "4096", "--max-num-seqs", "8", "--out",
                   str(tmp_path / "run"), env=cli_env(VLLM_API_KEY=CANARY))
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "launch-1" / "server.log").read_text()
    assert '" 200 OK' in log  # the access log's status, not a client's port ("127.0.0.1:34018")
    assert '" 401 ' not in log


def test_the_journal_keeps_a_server_flags_key_only_as_its_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [f"--api-key {CANARY}", "--port 8000"]
    RunRecord(path=tmp_path).append("run_started", options={"server_args": args})
    assert CANARY not in (tmp_path / "journal.jsonl").read_text()
    monkeypatch.setenv("PRETUNER_SERVE_API_KEY", CANARY)  # --resume reads it back from there
    started = next(RunRecord.open(tmp_path).of_kind("run_started"))
    assert started["options"]["server_args"] == args


def test_a_quoted_server_log_tail_holds_no_key(tmp_path: Path) -> None:
    """A failed launch's log tail goes into the report, the journal and `--json`: vLLM logs its
    arguments, the key among them, at start-up."""
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=7) INFO 11-27 10:00:01 [api_utils.py:273] non-default args: {'model_tag':"
        f" 'Qwen/Qwen3-8B', 'api_key': ['{CANARY}'], 'tokenizer': 'Qwen/Qwen3-8B', "
        "'max_num_seqs': 8}\n"
        f"INFO 11-27 10:00:01 api_server.py:713] args: Namespace(host=None, api_key='{CANARY}', "
        "hf_token=\"hf_x\", max_model_len=4096)\n")
    tail = read_tail(log)
    assert CANARY not in tail
    assert "hf_x" not in tail
    assert "'api_key': '<redacted>', 'tokenizer': 'Qwen/Qwen3-8B', 'max_num_seqs': 8}" in tail
    assert "(host=None, api_key='<redacted>', hf_token=\"<redacted>\", max_model_len=4096)" in tail
