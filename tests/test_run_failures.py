"""A failed `pretuner run` says why: report.json and report.md in its run folder, one JSON object
with --json, and its documented exit code (also with --debug)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pretuner.cli.app import error_json
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.errors import BadInputError, InfeasibleError, ServerFailedError
from pretuner.models import lookup
from pretuner.plan.layout import PlanConfig, plan
from pretuner.report.records import Step
from pretuner.tune.report import (
    RunMeta,
    failure_json,
    failure_md,
    plan_layout,
    step_json,
    unfinished_step,
)
from tests.helpers import R01_INFEASIBLE, FinishedRun, cli_env, invoke, run_cli

INFEASIBLE = ("run", *R01_INFEASIBLE)  # qwen3-8b at 40,960 tokens on 24 GiB: exit 4
SETTINGS = LaunchSettings(
    purpose=Purpose.PRERUN, card_gib=64, util=0.9, model_use_gib=50, max_model_len=16384,
    max_num_seqs=1, max_num_batched_tokens=16384, block_size=16, tp=1,
)  # fmt: skip


def files(run_dir: Path) -> tuple[dict[str, Any], str]:
    return json.loads((run_dir / "report.json").read_text()), (run_dir / "report.md").read_text()


def journal(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "journal.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# -- end to end on the emulated card --------------------------------------------------------


@pytest.mark.slow
def test_infeasible_run_writes_the_reason_the_launches_and_the_decisions(
    finished_run: Callable[..., FinishedRun],
) -> None:
    run = finished_run(*R01_INFEASIBLE)
    proc, out = run.proc, run.folder
    assert proc.returncode == 4, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("pretuner: error: qwen3-8b does not fit TP1")
    rep, md = files(out)
    assert rep["validated"] is False
    assert (rep["exit_code"], rep["error_type"]) == (4, "InfeasibleError")
    assert "even at --min-model-len 40,960" in rep["error"]
    assert "--tp 2" in rep["hint"]
    launched = sorted(p.name for p in out.glob("launch-*"))
    assert rep["launches"] == len(rep["steps"]) == len(launched) >= 1
    assert [s["outcome"] for s in rep["steps"]][-1] == "oom_at_start"
    events = journal(out)
    recorded = [{k: v for k, v in e.items() if k not in ("event", "time")}
                for e in events if e["event"] == "decision"]  # fmt: skip
    assert rep["decisions"] == recorded
    assert [e["outcome"]["kind"] for e in events if e["event"] == "launch"] == [
        s["outcome"] for s in rep["steps"]
    ]
    assert "run_stopped" in [e["event"] for e in events]
    assert "final" not in rep
    assert not (out / "tuned.env").exists()
    assert not (out / "serve.sh").exists()
    head = md.splitlines()
    assert head[0] == f"# pretuner run {out.name}: FAILED (exit 4, infeasible)"
    assert head[2].startswith("- reason: qwen3-8b does not fit TP1 on 24 GiB cards")
    assert head[3] == f"- fix: {rep['hint']}"
    assert "| 1 | prerun |" in md
    assert "## Decisions" in md
    assert all(f"**{d['decision']}**" in md for d in rep["decisions"])
    script = invoke("script", str(out))
    assert script.returncode == 2
    assert "failed (exit 4)" in script.stderr


@pytest.mark.slow
def test_json_prints_the_error_object_and_keeps_the_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(*INFEASIBLE, "--out", str(out), "--json", env=cli_env())
    assert proc.returncode == 4, proc.stderr
    obj = json.loads(proc.stdout)
    assert list(obj)[:6] == ["schema_version", "error", "hint", "exit_code", "error_type",
                             "run_record"]
    assert obj["exit_code"] == 4
    assert obj["run_record"] == str(out)
    rep, _ = files(out)
    assert {k: v for k, v in obj.items() if k != "run_record"} == rep
    assert proc.stderr.strip().splitlines()[-1] == f"pretuner: error: {obj['error']}; {obj['hint']}"


@pytest.mark.slow
def test_debug_prints_the_traceback_and_keeps_the_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("--debug", *INFEASIBLE, "--out", str(out), env=cli_env())
    assert proc.returncode == 4, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert "pretuner.errors.InfeasibleError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("pretuner: error: ")
    assert (out / "report.md").is_file()


@pytest.mark.slow
def test_launch_budget_used_up_is_reported_not_validated(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(
        "run", "--model", "qwen3-8b", "--card", "24", "--tp", "1", "--max-model-len", "40960",
        "--max-launches", "2", "--out", str(out), "--json",
    )  # fmt: skip
    assert proc.returncode == 6, proc.stderr
    obj = json.loads(proc.stdout)
    assert (obj["exit_code"], obj["error_type"]) == (6, "NotValidatedError")
    assert "launch budget of 2" in obj["error"]
    rep, md = files(out)
    assert rep["launches"] == 2
    assert md.splitlines()[0].endswith("FAILED (exit 6, not validated)")
    assert "- fix: raise --max-launches" in md


@pytest.mark.slow
def test_server_that_dies_at_start_is_listed_as_a_failed_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    fake = f"{sys.executable} {Path(__file__).parent / 'fakes' / 'fake_server.py'}"
    proc = run_cli("run", "--model", "qwen3-8b", "--card", "64", "--serve-cmd",
                   f"{fake} --die-at-start 3", "--ready-timeout", "5", "--stop-grace", "1",
                   "--out", str(out), env=cli_env())  # fmt: skip
    assert proc.returncode == 5, proc.stderr
    rep, md = files(out)
    last = rep["steps"][-1]
    assert (last["n"], last["outcome"], last["seconds"]) == (1, "failed", None)
    assert last["log"] == rep["server_log"] == str(out / "launch-1" / "server.log")
    lines = md.splitlines()
    assert lines[2].startswith("- reason: server exited")
    assert "last log lines" not in "\n".join(lines[:8])  # the log tail goes under Details
    assert "## Details" in md
    assert re.search(r"^\| 1 \| prerun \| .+ \| failed \| - \| - \| - \|$", md, re.MULTILINE)


def test_error_before_a_run_folder_prints_the_error_object(tmp_path: Path) -> None:
    proc = invoke("run", "--model", "deepseek-v4", "--card", "64", "--json", cwd=tmp_path)
    assert proc.returncode == 2
    obj = json.loads(proc.stdout)
    assert obj == {
        "schema_version": 2,
        "error": "unknown model 'deepseek-v4'",
        "hint": obj["hint"],
        "exit_code": 2,
        "error_type": "UnknownModelError",
        "run_record": None,
    }
    assert "deepseek-v3" in obj["hint"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("debug", [[], ["--debug"]])
def test_length_above_the_model_limit_names_the_vllm_override(
    tmp_path: Path, debug: list[str]
) -> None:
    proc = invoke(*debug, "run", "--model", "qwen3-8b", "--card", "32",
                  "--max-model-len", "65536", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.splitlines()[-1]
    assert "exceeds qwen3-8b's max_position_embeddings 40,960" in last
    assert "use --max-model-len 40960 or less" in last
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in last
    assert ("Traceback" in proc.stderr) == bool(debug)


# -- the pieces -----------------------------------------------------------------------------


def test_an_unfinished_launch_has_the_fields_of_a_finished_one() -> None:
    done = LaunchOutcome(
        n=1, settings=SETTINGS, kind=OutcomeKind.OK, worst_peak_mib=60000,
        rank_peaks_mib={"0": 60000}, oom_text=None, requests_ok=1, requests_total=1,
        ready_s=1.0, request_s=1.0, stop_s=1.0, total_s=3.0, overhead_s=0.1, log_path="a.log",
    )  # fmt: skip
    unfinished = unfinished_step(2, SETTINGS.to_json(), "b.log")
    assert list(unfinished.model_dump()) == list(step_json(done).model_dump())
    assert unfinished.settings == step_json(done).settings


def _failure(err: InfeasibleError | ServerFailedError, steps: list[Step]) -> str:
    meta = RunMeta(run_id="r1", engine="sim", simulated=True, card_source="given",
                   model_arg="qwen3-8b")  # fmt: skip
    p = plan(PlanConfig(model=lookup("qwen3-8b"), card_gib=64))
    rep = failure_json(err, meta, steps, [{"decision": "layout", "reason": "TP1"}], "r0.1",
                       **plan_layout(p))
    json.dumps(rep.model_dump(mode="json"))  # report.json holds plain JSON
    return failure_md(rep)


def test_failure_md_puts_the_reason_and_the_fix_first() -> None:
    err = ServerFailedError("server exited with code 3\nlast log lines:\nboom", log_path="s.log")
    md = _failure(err, [unfinished_step(1, SETTINGS.to_json(), "s.log")])
    lines = md.splitlines()
    assert lines[0] == "# pretuner run r1: FAILED (exit 5, server failed)"
    assert lines[2:5] == [
        "- reason: server exited with code 3",
        "- fix: read the server log and the decisions below",
        "- server log: s.log",
    ]
    assert "| 1 | prerun | util 0.9, model-use 50 GiB | 16,384 | 1 | failed | - | - | - |" in lines
    assert "- **layout**: TP1" in lines
    assert "```\nlast log lines:\nboom\n```" in md


def test_failure_md_without_a_launch() -> None:
    md = _failure(InfeasibleError("nothing fits", hint="use --tp 2"), [])
    assert md.splitlines()[2:4] == ["- reason: nothing fits", "- fix: use --tp 2"]
    assert "No launch was made." in md
    assert "## Details" not in md


def test_error_json_of_an_error_without_a_run() -> None:
    assert error_json(BadInputError("bad", hint="fix it")) == {
        "error": "bad", "hint": "fix it", "exit_code": 2, "error_type": "BadInputError",
        "run_record": None,
    }  # fmt: skip
