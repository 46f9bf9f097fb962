"""A launch whose rank cut its pool dump short: the run sees it in scan.json and the outcome,
on one machine and through the per-node scans of a Ray cluster."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from pretuner.cluster.collect import merge_node_scans, scan_node_folder
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.mindspore_r01 import outcome_of
from pretuner.engines.outcome import Exercised, LaunchOutcome, OutcomeKind
from pretuner.errors import ServerFailedError
from pretuner.launch.collect import LocalCollector
from tests.test_logscan_truncated import cut_after_header, cut_in_summary, cut_rank_dir

SETTINGS = LaunchSettings(
    purpose=Purpose.PRERUN, card_gib=2, util=0.55, model_use_gib=1, max_model_len=1024,
    max_num_seqs=1, max_num_batched_tokens=1024, block_size=16, tp=2,
)  # fmt: skip


def classify(folder: Path, *, graceful: bool = True) -> tuple[LaunchOutcome, dict[str, Any]]:
    collected = LocalCollector(folder, folder / "server.log").collect()
    outcome = outcome_of(
        1,
        SETTINGS,
        collected.scan,
        Exercised(1, 1, 0, None),
        failure=None,
        graceful=graceful,
        init_free_mib=[],
        log_path=folder / "server.log",
        problem=collected.problem,
        worst_node=None,
        rank_peaks_mib=collected.rank_peaks_mib,
        times=(0.0, 0.0, 0.0, 0.0),
    )
    return outcome, collected.doc


def test_cut_rank_is_in_scan_json_and_in_the_notes(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut_in_summary(0)})
    outcome, doc = classify(folder)
    assert outcome.kind is OutcomeKind.OK
    assert outcome.worst_peak_mib == 512
    [note] = outcome.notes
    assert note.startswith("rank 0 (pid 10537) wrote a truncated memory-pool dump")
    [cut] = doc["truncated"]
    assert (cut["rank"], cut["pid"]) == (0, 10537)
    assert cut["file"].endswith(".10537")


def test_every_dump_cut_fails_the_launch_by_name(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut_after_header(0), 1: cut_in_summary(1)})
    with pytest.raises(ServerFailedError, match="without a complete memory-pool dump") as err:
        classify(folder, graceful=False)
    assert "2 cut short, killed after the grace period" in str(err.value)
    assert "rank 0 (pid 10537)" in str(err.value)


def test_cut_rank_crosses_the_ray_wire_once(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {1: cut_after_header(1)})
    node = pickle.loads(pickle.dumps(scan_node_folder(str(folder), "n1", "head")))  # noqa: S301
    merged = merge_node_scans([node, node])  # a shared disk, seen by two nodes
    [cut] = merged.scan.truncated
    assert (cut.rank, cut.pid, cut.how.value) == (1, 10559, "summary_missing")
    assert merged.doc["truncated"][0]["pid"] == 10559
    assert merged.scan.ranks[1].truncated_dumps == 1
