"""report.json is one typed record: what a run writes, by either method, validates back into the
same record, the method's own figures are a union told apart by `method`, an unknown key is
refused, a report.json of schema 1 still reads, and the sums a V1 derivation prints add up."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from pretuner.report import SCHEMA_VERSION
from pretuner.report.records import (
    FailureReport,
    PinnedDerivation,
    R01Derivation,
    RunReport,
    read_report,
    report_of,
)
from pretuner.tune.entry import RunOptions, run_tuning
from tests.helpers import (
    R01_INFEASIBLE,
    R01_QWEN_64,
    V1_QWEN_80_32K,
    FinishedRun,
    cli_env,
)

pytestmark = pytest.mark.slow

# Each method's canonical run (tests/conftest.py), with --json, and its record.
METHODS: dict[str, tuple[tuple[str, ...], type[BaseModel]]] = {
    "r01": (R01_QWEN_64, R01Derivation),
    "v1": (V1_QWEN_80_32K, PinnedDerivation),
}


class CliRun:
    def __init__(self, out: Path, stdout: str) -> None:
        self.text = (out / "report.json").read_text()
        self.rep: dict[str, Any] = json.loads(self.text)
        self.printed: dict[str, Any] = json.loads(stdout)  # `--json`


@pytest.fixture(scope="module")
def cli_runs(finished_run: Callable[..., FinishedRun]) -> dict[str, CliRun]:
    runs = {}
    for name, (args, _) in METHODS.items():
        run = finished_run(*args)
        assert run.proc.returncode == 0, run.proc.stderr
        runs[name] = CliRun(run.folder, run.proc.stdout)
    return runs


@pytest.mark.parametrize("name", METHODS)
def test_report_json_of_a_cli_run_round_trips(cli_runs: dict[str, CliRun], name: str) -> None:
    run, model = cli_runs[name], RunReport
    record = model.model_validate(run.rep)
    assert isinstance(record.derivation, METHODS[name][1])  # told apart by `method`
    assert run.rep["schema_version"] == SCHEMA_VERSION
    assert model.model_validate_json(run.text) == record
    assert model.model_validate(run.printed) == record  # `--json` prints the same record
    dumped = record.model_dump(mode="json")
    assert list(dumped) == list(run.rep)  # report.json's key order
    assert json.dumps(dumped, indent=2) + "\n" == run.text  # byte for byte


@pytest.mark.parametrize("name", METHODS)
def test_the_outcome_record_is_what_report_json_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    for key, value in cli_env().items():
        monkeypatch.setenv(key, value)
    engine = "vllm" if name == "v1" else "sim"
    opts = RunOptions(model="qwen3-8b", card_gib=80 if name == "v1" else 64, engine=engine,
                      max_model_len=32768 if name == "v1" else None, out=str(tmp_path / "run"),
                      emulate=name == "v1")
    outcome = run_tuning(opts, lambda phase, detail: None)
    assert isinstance(outcome.report.derivation, METHODS[name][1])
    text = (outcome.record / "report.json").read_text()
    assert RunReport.model_validate_json(text) == outcome.report == read_report(outcome.record)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("where", ["top", "final", "derivation", "step", "settings"])
def test_an_unknown_key_is_refused(cli_runs: dict[str, CliRun], name: str, where: str) -> None:
    rep = json.loads(cli_runs[name].text)
    block = {"top": rep, "final": rep["final"], "derivation": rep["derivation"],
             "step": rep["steps"][0], "settings": rep["steps"][0]["settings"]}[where]
    block["kv_cache_gb"] = 1  # a typo'd key
    with pytest.raises(ValidationError, match="kv_cache_gb"):
        RunReport.model_validate(rep)


def test_a_derivation_is_one_methods_and_no_other(cli_runs: dict[str, CliRun]) -> None:
    rep = json.loads(cli_runs["v1"].text)
    rep["derivation"]["method"] = "r0.1"  # the pinned method's figures under r0.1's name
    with pytest.raises(ValidationError, match="r0.1"):
        RunReport.model_validate(rep)
    rep["derivation"]["method"] = "guess"
    with pytest.raises(ValidationError, match="method"):
        RunReport.model_validate(rep)


def test_a_missing_key_is_refused(cli_runs: dict[str, CliRun]) -> None:
    rep = json.loads(cli_runs["v1"].text)
    del rep["final"]["kv_tokens"]
    with pytest.raises(ValidationError, match="kv_tokens"):
        RunReport.model_validate(rep)


def test_a_record_is_frozen(cli_runs: dict[str, CliRun]) -> None:
    record = RunReport.model_validate(cli_runs["v1"].rep)
    with pytest.raises(ValidationError):
        record.validated = False


def test_a_single_node_report_has_no_cluster_key_and_a_cluster_comes_last(
    cli_runs: dict[str, CliRun],
) -> None:
    rep = cli_runs["r01"].rep
    assert "cluster" not in RunReport.model_validate(rep).model_dump(mode="json")
    cluster = {"gcs_address": "10.0.0.1:6379", "nodes": [{"node": "a", "ranks": 8, "local": True}]}
    dumped = RunReport.model_validate({**rep, "cluster": cluster}).model_dump(mode="json")
    assert list(dumped)[-1] == "cluster"
    assert dumped["cluster"] == cluster


def test_a_failure_report_validates(finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*R01_INFEASIBLE)  # does not fit
    assert run.proc.returncode == 4, run.proc.stderr
    rep = run.report()
    record = report_of(rep)
    assert isinstance(record, FailureReport)
    assert record.model_dump(mode="json") == rep
    assert (record.error_type, record.method) == ("InfeasibleError", "r0.1")


FIXTURES = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200"
GOLDEN = Path(__file__).parent / "golden" / "run"


@pytest.mark.parametrize(("folder", "method"), [
    pytest.param(GOLDEN, R01Derivation, id="r01-before-the-sampler"),
    pytest.param(FIXTURES / "run8k", PinnedDerivation, id="v1-real-h200"),
])
def test_a_report_of_schema_1_still_reads(folder: Path, method: type[BaseModel]) -> None:
    old = json.loads((folder / "report.json").read_text())
    assert old.get("schema_version", 1) == 1
    rep = read_report(folder)
    assert isinstance(rep, RunReport)
    assert isinstance(rep.derivation, method)
    assert rep.run_id == old["run_id"]
    assert rep.final.kv_tokens == old.get("max_kv_tokens") or old["final"]["kv_tokens"]
    # Upgraded once, the record round-trips as schema 2.
    assert report_of(rep.model_dump(mode="json")) == rep


# -- the printed arithmetic -----------------------------------------------------------------

MIB_FIGURE = re.compile(r"([\d,]+(?:\.\d+)?) MiB")


def _figure(text: str) -> float:
    m = MIB_FIGURE.search(text)
    assert m is not None, text
    return float(m.group(1).replace(",", ""))


def _sum_of(line: str) -> tuple[float, float]:
    """`name = a MiB - b MiB ... = result MiB`: (a - b ..., result)."""
    _, expression, result = line.split(" = ", 2)
    first, *rest = re.split(r" ([-+]) ", expression)  # "non-KV" has no spaces round its dash
    total = _figure(first)
    for sign, term in zip(rest[::2], rest[1::2], strict=True):
        total += -_figure(term) if sign == "-" else _figure(term)
    return total, _figure(result)


def test_every_printed_sum_of_the_v1_derivation_adds_up(cli_runs: dict[str, CliRun]) -> None:
    pinned = RunReport.model_validate(cli_runs["v1"].rep).derivation
    assert isinstance(pinned, PinnedDerivation)
    d = pinned.budget
    assert d is not None
    assert len(d.lines) == 3
    sums, margin = d.lines[:2], d.lines[2]
    # The margin's line says what it is made of: the larger of a share of the device and the
    # spread kept plus what a proof may add, whose figures add up too.
    m = re.fullmatch(r"margin ([\d,]+) MiB = the larger of ([\d,]+) MiB \(.*\) and ([\d,]+) MiB "
                     r"\(the boot-to-boot spread kept, ([\d,]+) MiB, \+ ([\d,]+) MiB .*\)", margin)
    assert m is not None, margin
    kept, share, floor, spread, proof = (int(g.replace(",", "")) for g in m.groups())
    assert kept == d.margin_mib == max(share, floor)
    assert floor == spread + proof
    for line in sums:
        total, result = _sum_of(line)
        if line.endswith("rounded down to a MiB"):
            assert result <= total + 0.1 < result + 1.1, line  # inputs printed to 0.1 MiB
        else:
            assert total == pytest.approx(result, abs=0.15), line
    # and the figures are the record's
    assert _sum_of(d.lines[0]) == pytest.approx(
        (d.device_peak_mib - d.held_kv_mib, d.non_kv_peak_mib), abs=0.1)
    assert _sum_of(d.lines[1])[1] == d.pinned_kv_mib
