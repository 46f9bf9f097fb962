"""`pretuner sweep FILE.yaml`: the file's format (a bad entry is one line naming the file's line,
before anything runs), and four emulated tunings one after another, one failing, interrupted
and resumed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import cli_env, default_sigint, invoke, processes_holding, wait_for

GOOD = "- name: a\n  model: qwen3-8b\n  engine: vllm\n  emulate: true\n"


@pytest.mark.parametrize(("text", "said"), [
    # rule: every key is a `run` option by its long name; the line of the key is named
    (GOOD + "  max-num-seq: 64\n",
     "s.yaml:5: tuning 'a': unknown key 'max-num-seq'; did you mean max-num-seqs?"),
    (GOOD + "  out: elsewhere\n", "s.yaml:5: tuning 'a': unknown key 'out'"),  # the sweep's own
    # rule: every value is one `run` takes, checked by run's own parser
    (GOOD + "  card: 80\n  max-num-seqs: many\n",
     "s.yaml:6: tuning 'a': Invalid value for '--max-num-seqs': Input should be a valid "
     "integer"),
    (GOOD + "  max-model-len: 32Q\n", "s.yaml:5: tuning 'a': Invalid value for "
     "'--max-model-len': '32Q' is not a whole number"),
    (GOOD.replace("true", "maybe"), "s.yaml:4: emulate: Input should be a valid boolean"),
    (GOOD + "  server-arg: {a: 1}\n", "s.yaml:5: server-arg: Input should be a valid string"),
    # rule: the file's shape
    ("- name: a\n  engine: vllm\n", "s.yaml:1: model: Field required"),
    ("- name: Bad Name\n  model: qwen3-8b\n", "s.yaml:1: name: String should match pattern"),
    (GOOD + GOOD, "s.yaml:5: a second tuning named 'a'"),
    ("model: qwen3-8b\n", "s.yaml: a sweep file is a list of tunings"),
    ("- [qwen3-8b]\n", "s.yaml:1: a tuning is a mapping of run options"),
    ("- {model: qwen3-8b\n", "s.yaml:2: not YAML"),
])  # fmt: skip
def test_a_bad_sweep_file_is_one_line_naming_its_line(tmp_path: Path, text: str,
                                                      said: str) -> None:
    (tmp_path / "s.yaml").write_text(text)
    proc = invoke("sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "sw"))
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"pretuner: error: {tmp_path / said}"), line
    assert not (tmp_path / "sw").exists()  # refused before anything is written


def test_each_entry_is_the_run_command_line_it_names(tmp_path: Path) -> None:
    """Keys become `run` flags: a false switch its --no- form, a list a repeated flag."""
    from pretuner.cli.sweep import _command, _flags, _long_names
    from pretuner.sweep import read_sweep

    (tmp_path / "s.yaml").write_text(
        "- {model: qwen3-8b, engine: vllm, emulate: true, validate: false, max-model-len: 32K,"
        " server-arg: ['--seed 1', '--load-format dummy'], enforce-eager: true}\n"
        "- {model: ./models/My_Model, engine: sim, tp: 2}\n")
    first, second = read_sweep(tmp_path / "s.yaml")
    flags = _flags(_long_names(_command("run")))
    assert first.args(flags) == [
        "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--no-validate",
        "--max-model-len", "32K", "--server-arg", "--seed 1", "--server-arg",
        "--load-format dummy", "--enforce-eager"]
    assert (second.name, second.args(flags)) == (
        "02-my-model-sim", ["--model", "./models/My_Model", "--engine", "sim", "--tp", "2"])


def test_a_new_sweep_never_writes_into_a_folder_in_use(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(GOOD)
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "mine.txt").write_text("keep")
    proc = invoke("sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "sw"))
    assert proc.returncode == 2
    assert "exists and is not empty" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "sw").iterdir()) == ["mine.txt"]


V1 = "engine: vllm, emulate: true, max-model-len: 4096, max-num-seqs: 8"
SWEEP = f"""\
- {{name: v1-80, model: qwen3-8b, card: 80, {V1}}}
- {{name: r01-64, model: qwen3-8b, engine: sim, card: 64, max-model-len: 8192}}
- {{name: no-fit, model: qwen3-32b, card: 40, tp: 1, {V1}}}
- {{name: v1-40, model: qwen3-8b, card: 40, {V1}}}
"""


@pytest.mark.slow
def test_four_tunings_one_failing_interrupted_and_resumed(tmp_path: Path) -> None:
    """One after another: a failing tuning is recorded with its exit code and reason and the
    others go on; Ctrl-C stops the running one (no process left in its folder) and `--resume`
    keeps the finished ones; the summary's rows are each run's report.json."""
    (tmp_path / "s.yaml").write_text(SWEEP)
    sw, err = tmp_path / "sw", tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretuner", "sweep", str(tmp_path / "s.yaml"), "--out",
             str(sw)], env=cli_env(), stdout=subprocess.DEVNULL, stderr=stderr,
            stdin=subprocess.DEVNULL, preexec_fn=default_sigint)  # noqa: S603, PLW1509
        try:
            wait_for(err, "start  r01-64", timeout=120)
            wait_for(sw / "r01-64" / "journal.jsonl", "launch", timeout=60)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    assert f"resume with: pretuner sweep {tmp_path / 's.yaml'} --resume {sw}" in err.read_text()
    assert processes_holding(sw / "r01-64" / "journal.jsonl") == []
    first = json.loads((sw / "summary.json").read_text())
    assert [r["outcome"] for r in first["tunings"]] == [
        "validated", "interrupted", "not run", "not run"]
    v1_80 = (sw / "v1-80" / "report.json").read_bytes()

    t0 = time.monotonic()
    again = subprocess.run(
        [sys.executable, "-m", "pretuner", "sweep", str(tmp_path / "s.yaml"), "--resume",
         str(sw), "--json"], env=cli_env(), capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL)  # noqa: S603
    assert again.returncode == 10, again.stderr  # one tuning did not validate
    assert time.monotonic() - t0 < 120
    assert "kept   v1-80  finished in an earlier session" in again.stderr
    assert (sw / "v1-80" / "report.json").read_bytes() == v1_80  # not run again
    doc = json.loads(again.stdout)
    assert doc == {"schema_version": doc["schema_version"],
                   **json.loads((sw / "summary.json").read_text())}
    rows = {r["name"]: r for r in doc["tunings"]}
    assert (rows["no-fit"]["outcome"], rows["no-fit"]["exit_code"]) == ("failed", 4)
    assert rows["no-fit"]["reason"].startswith("TP1 x PP1: qwen3-32b's weights take 61.02 GiB")
    assert rows["no-fit"]["run_folder"] is None
    for name in ("v1-80", "r01-64", "v1-40"):
        rep = json.loads((sw / name / "report.json").read_text())
        row = rows[name]
        assert (row["outcome"], row["proven"], rep["validated"]) == ("validated", True, True)
        assert (row["model"], row["card_gib"], row["engine"], row["provenance"]) == (
            rep["model"], rep["card_gib"], rep["engine"], rep["provenance"])
        assert (row["max_model_len"], row["max_num_seqs"]) == (
            rep["final"]["max_model_len"], rep["final"]["max_num_seqs"])
        pinned = rep["derivation"].get("kv_cache_memory_bytes")
        assert row["kv_mib"] == (pinned // 2**20 if pinned else round(rep["final"]["kv_gib"] * 1024))
        assert row["run_folder"] == str(sw / name)
        preset = json.loads((sw / "presets" / f"{rep['model']}-tp1-{rep['card_gib']}g"
                             f"{'-vllm' if pinned else ''}-simulated-{name}.json").read_text())
        assert preset["kv_tokens"] == rep["final"]["kv_tokens"]
    assert len(doc["presets"]) == 3
    md = (sw / "summary.md").read_text()
    assert "| no-fit | qwen3-32b | 40 GB | vllm | failed (exit 4: TP1 x PP1:" in md
    assert f"| v1-80 | qwen3-8b | 80 GB | vllm | validated | {rows['v1-80']['kv_mib']:,} |" in md
    assert f"| r01-64 | qwen3-8b | 64 GiB | sim | validated | {rows['r01-64']['kv_mib']:,} " in md
    # The run folders are normal ones: `report` reads them.
    report = invoke("report", str(sw / "v1-40"), "--out", str(tmp_path / "v1-40.html"))
    assert report.returncode == 0, report.stderr


# Rule: `pretuner run`'s exit code for a finished run: 6 when the proof was asked and did not
# hold, 9 when it held less than asked, 0 otherwise (a run told not to validate included).
@pytest.mark.parametrize(("validated", "validate", "given_up", "code"), [
    (True, True, False, 0), (True, True, True, 9), (False, True, False, 6),
    (False, True, True, 6), (False, False, False, 0), (False, False, True, 9),
])
def test_a_finished_runs_exit_code(validated: bool, validate: bool, given_up: bool,
                                   code: int) -> None:
    from pretuner.errors import ExitCode

    assert ExitCode.of_finished_run(validated, validate, given_up) == code


# Rule: a tuning whose run finished (its journal says so) before a stop reached the sweep is
# taken as it ended when the sweep resumes, never run again: `--resume` refuses a finished
# run (exit 2), which had turned a SIGTERM landing just after the run's end into a failure.
@pytest.mark.parametrize(("validated", "given_up", "code"), [
    (True, None, 0), (True, ["max_model_len"], 9), (False, None, 6),
])
def test_a_tuning_that_finished_before_the_stop_is_not_run_again(
        tmp_path: Path, validated: bool, given_up: list[str] | None, code: int) -> None:
    from pretuner.sweep import run_one

    folder = tmp_path / "sweep" / "qwen3-8b"
    folder.mkdir(parents=True)
    events = [{"event": "run_started", "options": {"validate": True}, "time": 1.0},
              {"event": "run_finished", "validated": validated, "time": 2.0}]
    (folder / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    report = {"validated": validated, "given_up": given_up}
    (folder / "report.json").write_text(json.dumps(report))
    # Arguments `pretuner run` would refuse: had it been started, the code would be 2.
    result = run_one(["--no-such-flag"], str(folder))
    assert result["exit_code"] == code
    assert result["report"] == report
    assert (result["reason"] is None) == (code == 0)
    assert not (tmp_path / "sweep" / ".qwen3-8b.stderr").exists()  # nothing was started
