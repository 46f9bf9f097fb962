"""One redaction for everything pretuner writes or prints (issue 28 item 1): a canary secret
given each way a user can give one appears in no file of the run folder, the preset, the
script output, stdout or stderr.

Fast: the text rule against the log shapes engines print (and real logs left as they are), the
memory of secrets seen once, the log scrub, the console. Slow: real runs on the emulated
engines, one per way, every file of the run folder grepped.
"""

from __future__ import annotations

import io
import json
import shlex
import stat
import sys
from pathlib import Path

import pytest

from pretuner.cli.app import Redacting
from pretuner.files import scrub, write_atomic
from pretuner.redact import REDACTED, redact_text, remember_secrets
from tests.helpers import cli_env, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
REAL_LOGS = sorted(FIXTURES.rglob("*.log"))  # real engines, no secret in them
CANARY = "CANARY-5e3b1f7a"  # every secret below starts with it: one grep finds them all


@pytest.mark.parametrize(("line", "shown"), [
    pytest.param(  # vLLM 0.6.6's own arguments at start-up
        f"INFO 11-27 api_server.py:713] args: Namespace(host=None, api_key='{CANARY}', port=8)",
        f"INFO 11-27 api_server.py:713] args: Namespace(host=None, api_key='{REDACTED}', port=8)",
        id="namespace"),
    pytest.param(  # real vLLM's line (api_utils.py:273), the key a list of one
        f"(APIServer pid=7) INFO [api_utils.py:273] non-default args: {{'model_tag': 'm', "
        f"'api_key': ['{CANARY}'], 'max_model_len': 32768}}",
        f"(APIServer pid=7) INFO [api_utils.py:273] non-default args: {{'model_tag': 'm', "
        f"'api_key': '{REDACTED}', 'max_model_len': 32768}}", id="non-default-args"),
    pytest.param("huggingface_hub: token hf_AbCdEf0123456789xyz is valid",
                 f"huggingface_hub: token {REDACTED} is valid", id="hf-token"),
    pytest.param("curl -H 'Authorization: Bearer sk-Zx9_y.8' http://h/v1/models",
                 f"curl -H 'Authorization: Bearer {REDACTED}' http://h/v1/models", id="bearer"),
    pytest.param("{'hf_token': \"T0\", 'api-key': 'K0', 'max_num_batched_tokens': '8'}",
                 f"{{'hf_token': \"{REDACTED}\", 'api-key': '{REDACTED}', "
                 "'max_num_batched_tokens': '8'}", id="repr-names"),
    pytest.param(f"model: m\napi-key: {CANARY}\n  - hf_token: {CANARY} # x\nmax-model-len: 8",
                 f"model: m\napi-key: {REDACTED}\n  - hf_token: {REDACTED}\nmax-model-len: 8",
                 id="yaml-lines"),
    pytest.param("requests send it as a bearer token; Bearer tokens expire",
                 "requests send it as a bearer token; Bearer tokens expire", id="bearer-prose"),
    # a variable serve.sh reads a secret from is no secret
    pytest.param('--api-key "$PRETUNER_SERVE_API_KEY" -H "Authorization: Bearer $VLLM_API_KEY"',
                 '--api-key "$PRETUNER_SERVE_API_KEY" -H "Authorization: Bearer $VLLM_API_KEY"',
                 id="variables-kept"),
])  # fmt: skip
def test_secret_shapes_in_free_text_are_redacted(line: str, shown: str) -> None:
    """Rule: a secret an engine logs (its own arguments, a token, a bearer credential) is
    hidden wherever the line is quoted or kept, whether or not pretuner was told the value."""
    assert redact_text(line) == shown
    assert redact_text(shown) == shown  # the same rule twice changes nothing


def test_redacted_json_is_still_json_and_keeps_what_is_no_secret() -> None:
    """Rule: `--json` output and report.json pass through the redaction: a secret in them
    becomes a JSON string, and a unit or provenance named like a secret (`kv_bytes_per_token`)
    is kept."""
    doc = {"api_key": [CANARY], "hf_token": CANARY, "kv_bytes_per_token": "measured (log)",
           "eos_token": "<|im_end|>", "served": ["qwen"]}
    assert json.loads(redact_text(json.dumps(doc))) == {
        **doc, "api_key": REDACTED, "hf_token": REDACTED}
    # Indented, as `--json` prints: a list over several lines is left to the values pretuner
    # saw given as secrets (the rules read a line at a time), the rest is the same.
    del doc["api_key"]
    assert json.loads(redact_text(json.dumps(doc, indent=2))) == {**doc, "hf_token": REDACTED}


@pytest.mark.parametrize("log", REAL_LOGS, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_real_logs_without_secrets_are_left_byte_for_byte(log: Path) -> None:
    """Rule: the redaction hides secrets only: every real engine log we hold (no secret in
    them) reads the same after it, so a scrubbed log scans to the same figures."""
    text = log.read_text(encoding="utf-8", errors="surrogateescape")
    assert redact_text(text) == text


def test_a_value_seen_once_as_a_secret_is_hidden_in_any_text() -> None:
    """Rule: a value given as `--api-key K`, `--api_key=K` or in `-e HF_TOKEN=K` is hidden
    anywhere it turns up later (an error, a log line the shapes do not know); short values
    are not looked for in free text, so that `X_TOKEN=1` cannot hide every "1"."""
    key, eq, hf, env, short = f"{CANARY}-a", f"{CANARY}-b", f"{CANARY}-c", f"{CANARY}-d", "x1"
    remember_secrets(["run", "--server-arg", f"--api-key {key} --api_key={eq}", "--serve-cmd",
                      f"docker run -e HF_TOKEN={hf} --env=X_TOKEN={short} img"],
                     {"VLLM_API_KEY": env, "PATH": "/usr/bin"})
    for value in (key, eq, hf, env):
        assert redact_text(f"server says: unknown served name {value}!") == (
            f"server says: unknown served name {REDACTED}!")
    assert redact_text(f"--env=X_TOKEN={short} x1") == f"--env=X_TOKEN={short} x1"  # too short
    assert redact_text("/usr/bin") == "/usr/bin"  # not a secret's name: not learned


def test_every_file_pretuner_writes_and_every_line_it_prints_is_redacted(
        tmp_path: Path) -> None:
    """Rule: the one file writer and the console (stdout, stderr, logging) go through the
    redaction: no writer can forget it."""
    remember_secrets(["--server-arg", f"--api-key {CANARY}-w"], {})
    path = write_atomic(tmp_path / "report.md", f"- error: bad key {CANARY}-w\n")
    assert path.read_text() == f"- error: bad key {REDACTED}\n"
    out = io.StringIO()
    Redacting(out).write(f"pretuner: error: server said {CANARY}-w\n")
    assert out.getvalue() == f"pretuner: error: server said {REDACTED}\n"


def test_a_server_log_is_scrubbed_in_place_line_for_line(tmp_path: Path) -> None:
    """Rule: a server prints its own --api-key into server.log, in the run folder: the log is
    rewritten without it, every other byte and the line count kept; a clean log is left
    untouched (same file, same time)."""
    log = tmp_path / "server.log"
    lines = ["INFO start\n", f"INFO args: Namespace(api_key='{CANARY}', port=8)\r\n",
             "bad byte \udcff here\n", "INFO ready"]  # no final newline
    log.write_text("".join(lines), encoding="utf-8", errors="surrogateescape")
    log.chmod(0o600)
    assert scrub(log)
    text = log.read_bytes().decode("utf-8", errors="surrogateescape")
    assert CANARY not in text
    assert text == "".join(lines).replace(CANARY, REDACTED)
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    before = log.stat()
    assert not scrub(log)
    assert (log.stat().st_ino, log.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(tmp_path.glob(".server.log.*"))  # no temp file left


# --- Real runs, one per way a secret is given -------------------------------------------------

# Prints what engines print at start-up (the key among their arguments, a Hugging Face token, a
# request's headers), then fails: the failed launch's quoted tail carries every shape.
FAILING_SERVER = f"""\
import sys
print("INFO api_server.py:713] args: Namespace(host=None, api_key='{CANARY}-ns', port=8)")
print("(APIServer pid=7) INFO [api_utils.py:273] non-default args: {{'api_key': ['{CANARY}-nd']}}")
print("DEBUG hub: using token hf_{CANARY[7:]}0123456789")
print("DEBUG headers: {{'Authorization': 'Bearer {CANARY}-bearer'}} Authorization: Bearer {CANARY}-b2")
print("RuntimeError: the device is gone", file=sys.stderr)
sys.exit(1)
"""
WRAPPER = """\
import os, sys
# A `docker run` of its own: takes its environment words, runs the rest.
args, env = sys.argv[1:], dict(os.environ)
while args and args[0].startswith("-"):
    word = args.pop(0)
    if word in ("-e", "--env"):
        word = "--env=" + args.pop(0)
    name, _, value = word.removeprefix("--env=").partition("=")
    env[name] = value
os.execvpe(args[0], args, env)
"""


def _way(tmp_path: Path, way: str) -> list[str]:
    """`pretuner run` arguments that give CANARY... the way named."""
    # 16 sequences: the width does not matter here, and a 1,024-wide burst costs seconds a run.
    v1 = ["--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
          "--max-model-len", "4096", "--max-num-seqs", "16"]
    if way.startswith("server-arg"):
        flag = {"server-arg": "--api-key ", "server-arg-underscore": "--api_key ",
                "server-arg-equals": "--api-key="}[way]
        return [*v1, "--server-arg", f"{flag}{CANARY}-{way}"]
    if way.startswith("config"):
        cfg = tmp_path / "serve.yaml"
        key = way.removeprefix("config-")
        cfg.write_text(f"model: qwen3-8b\nmax-model-len: 4096\nmax-num-seqs: 16\n"
                       f"{key}: {CANARY}-{way}\n")
        return ["--config", str(cfg), "--engine", "vllm", "--emulate", "--card", "80"]
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    if way == "wrapper-env":  # every spelling a container runner takes
        sim = shlex.join([sys.executable, str(wrapper), f"--env=HF_TOKEN={CANARY}-e1",
                          "-e", f"HF_TOKEN={CANARY}-e2", "--env", f"HF_TOKEN={CANARY}-e3",
                          sys.executable, "-m", "pretuner.sim", "vllm", "serve"])
        return [*v1, "--serve-cmd", sim]
    if way == "r01-serve-cmd":  # the r0.1 engine takes no --server-arg: the key in its command
        sim = shlex.join([sys.executable, "-m", "pretuner.sim", "serve", "--api-key",
                          f"{CANARY}-r01"])
        return ["--model", "qwen3-8b", "--engine", "sim", "--card", "64", "--serve-cmd", sim]
    assert way == "failed-launch"
    server = tmp_path / "failing.py"
    server.write_text(FAILING_SERVER)
    cmd = shlex.join([sys.executable, str(wrapper), "-e", f"HF_TOKEN={CANARY}-env",
                      sys.executable, str(server), "--api-key", f"{CANARY}-flag"])
    return [*v1, "--serve-cmd", cmd]


def _leaks(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*")
            if p.is_file() and CANARY.encode() in p.read_bytes()]


@pytest.mark.slow
@pytest.mark.parametrize("way", [
    "server-arg", "server-arg-underscore", "server-arg-equals", "config-api-key",
    "config-api_key", "wrapper-env", "r01-serve-cmd", "failed-launch"])
def test_a_canary_secret_given_each_way_is_written_and_printed_nowhere(
        tmp_path: Path, way: str) -> None:
    """Rule: whichever way a secret is given, no file of the run folder (the servers' logs
    included), no preset, no script and no output holds it; the server still got it and
    serve.sh names the variable to set."""
    run, presets, scripts = tmp_path / "run", tmp_path / "presets", tmp_path / "scripts"
    presets.mkdir()
    env = cli_env()
    proc = run_cli("run", *_way(tmp_path, way), "--out", str(run), "--json", env=env)
    printed = [proc.stdout + proc.stderr]
    if way == "failed-launch":
        assert proc.returncode == 5, proc.stderr  # the server failed, its tail quoted
        assert "the device is gone" in proc.stderr
        assert f"api_key='{REDACTED}'" in (run / "report.md").read_text()
    else:
        assert proc.returncode == 0, proc.stderr
        server_log = (run / "launch-1" / "server.log").read_text()
        assert "api_key" not in way or f"'api_key': '{REDACTED}'" in server_log \
            or f"api_key='{REDACTED}'" in server_log  # the server logged what it got
        serve = (run / "serve.sh").read_text()
        assert "export PRETUNER_SERVE_" in serve
        for args in (["presets", "add", str(run), "--out", str(presets)], ["script", str(run)],
                     ["script", str(run), "--out", str(scripts)]):
            done = run_cli(*args, env=env)
            assert done.returncode == 0, (args, done.stderr)
            printed.append(done.stdout + done.stderr)
        named = [p for p in presets.iterdir() if p.suffix in (".yaml", ".yml", ".json")]
        assert named, list(presets.iterdir())
        shown = run_cli("script", "--preset", str(named[0]), env=env)
        assert shown.returncode == 0, shown.stderr
        printed.append(shown.stdout + shown.stderr)
    assert all(CANARY not in text for text in printed), printed
    assert _leaks(tmp_path / "run") == []
    assert _leaks(presets) == []
    assert _leaks(scripts) == []
