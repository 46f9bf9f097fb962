"""`scan` and `analyze` on a real two-rank log whose one rank cut its pool dump short.

Rank 0 (pid 10537) peaks at 128 MiB, rank 1 (pid 10559) at 512 MiB. A cut rank still counts
towards the derived TP, its peak is reported as unknown, and the cut is named with its pid.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pretuner.analyze import AnalyzeConfig
from pretuner.analyze.front import analyze_logs
from pretuner.analyze.r01 import R01Analysis
from pretuner.errors import InfeasibleError, NothingFoundError
from pretuner.logscan.result import Truncation
from pretuner.models import resolve
from tests.helpers import invoke
from tests.test_logscan_truncated import (
    RANK_LOGS,
    cut_after_header,
    cut_in_summary,
    cut_rank_dir,
)

# The fixture's peaks are tiny: a 2 GiB card at util 0.55 with 1 GiB model-use leaves 0.1 GiB
# of KV cache in the pre-run, below either rank's peak.
ARGS = ["--model", "tiny-llama", "--card", "2", "--util", "0.55", "--model-use-gb", "1",
        "--max-model-len", "1024"]  # fmt: skip


def config(folder: Path) -> AnalyzeConfig:
    return AnalyzeConfig(
        paths=(folder,),
        model=resolve("tiny-llama"),
        card_gib=2,
        util=0.55,
        model_use_gib=1,
        max_model_len=1024,
    )


def test_scan_json_names_the_cut_rank(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {1: cut_in_summary(1)})
    done = invoke("scan", str(folder), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    [cut] = doc["truncated"]
    assert (cut["rank"], cut["pid"], cut["how"]) == (1, 10559, "summary_cut")
    assert cut["file"].endswith(RANK_LOGS[1].name)
    assert [(r["rank"], r["actual_peak_mib"]) for r in doc["ranks"]] == [(0, 128), (1, None)]
    assert "rank 1 (pid 10559) wrote a truncated memory-pool dump" in done.stderr


def test_scan_text_says_truncated(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut_after_header(0)})
    done = invoke("scan", str(folder))
    assert done.returncode == 0, done.stderr
    assert "unknown (cut)" in done.stdout
    assert "worst may be higher" in done.stdout
    [line] = [x for x in done.stdout.splitlines() if x.startswith("TRUNCATED")]
    assert "rank 0 (pid 10537)" in line
    assert "summary line with `actual peak used` is not" in line


@pytest.mark.parametrize("cut", [cut_in_summary, cut_after_header], ids=["cut", "missing"])
def test_analyze_counts_the_cut_rank(tmp_path: Path, cut: Callable[[int], bytes]) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut(0)})
    result = analyze_logs(config(folder))
    assert isinstance(result, R01Analysis)
    assert (result.tp, result.tp_source) == (2, "derived")  # not 1: rank 0 wrote a dump
    assert (result.worst.rank, result.worst.pid, result.worst.actual_peak_mib) == (1, 10559, 512)
    [record] = result.scan.truncated
    assert (record.rank, record.pid) == (0, 10537)
    expected = Truncation.SUMMARY_CUT if cut is cut_in_summary else Truncation.SUMMARY_MISSING
    assert record.how is expected
    data = result.to_json()
    assert data["truncated"][0]["pid"] == 10537
    assert [(r["rank"], r["actual_peak_mib"]) for r in data["ranks"]] == [(0, None), (1, 512)]
    assert data["provenance"]["actual_peak_mib"] == "measured, without the truncated dumps"


def test_analyze_cli_reports_the_cut_rank(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut_in_summary(0)})
    done = invoke("analyze", str(folder), *ARGS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tiny-llama, TP2 (derived)")
    assert "rank 0: unknown" in done.stdout
    assert "warning: rank 0 (pid 10537) wrote a truncated memory-pool dump" in done.stdout
    assert "(at least 128 MiB" in done.stdout
    done = invoke("analyze", str(folder), *ARGS, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["tp"] == 2
    assert data["truncated"][0]["pid"] == 10537
    assert "pid 10537" in done.stderr


def test_analyze_refuses_when_the_cut_rank_peaked_higher(tmp_path: Path) -> None:
    """Rank 1 printed `peak used mem:512M` before its cut: the 128 MiB of rank 0 is too low."""
    folder = cut_rank_dir(tmp_path, {1: cut_in_summary(1)})
    with pytest.raises(InfeasibleError, match=r"pid 10559.*at least 512 MiB"):
        analyze_logs(config(folder))
    done = invoke("analyze", str(folder), *ARGS)
    assert done.returncode == 4
    assert "rank 1 (pid 10559) wrote a truncated memory-pool dump" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_analyze_with_every_dump_cut(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut_in_summary(0), 1: cut_after_header(1)})
    with pytest.raises(NothingFoundError, match=r"2 truncated, first: rank 0 \(pid 10537\)"):
        analyze_logs(config(folder))
    done = invoke("analyze", str(folder), *ARGS)
    assert done.returncode == 3
    assert "no complete pool dump" in done.stderr
