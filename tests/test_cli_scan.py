"""`pretuner scan` through the console entry point (in-process)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.helpers import invoke

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def scan(*args: str) -> subprocess.CompletedProcess[str]:
    return invoke("scan", *args)


def test_json_keys() -> None:
    logs = [FIXTURES / "ms_rank_dir", FIXTURES / "ms_cpu_exit.log", FIXTURES / "ms_cpu_oom.log"]
    done = scan(*map(str, logs), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert {"ranks", "worst_actual_peak_mib", "oom", "unreadable"} <= doc.keys()
    assert doc["worst_actual_peak_mib"] == 512
    assert {"rank", "pid", "actual_peak_mib"} <= doc["ranks"][0].keys()
    assert [r["rank"] for r in doc["ranks"] if r["rank"] is not None] == [0, 1]
    [oom] = doc["oom"]
    assert oom["kind"] == "device_oom"
    assert {"kind", "line", "text"} <= oom.keys()
    assert "card_mib" not in doc  # no init line on CPU


def test_engine_figures_in_json(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO 05-16 23:06:54 [gpu_worker.py:1] Available KV cache memory: 44.30 GiB\n"
        "INFO 05-16 23:06:54 [kv_cache_utils.py:1] GPU KV cache size: 645,120 tokens\n"
        "[INFO] DEVICE(7,7f,python):2025 [a.cc:1] f] Device MOC Size:65536M, Device free MOC "
        "Size:62000M, User define MindSpore MOC Size:57G, MindSpore Used MOC Size:58368M.\n"
    )
    doc = json.loads(scan(str(log), "--json").stdout)
    assert doc["kv_cache_tokens"] == 645120
    assert doc["available_kv_gib"] == 44.3
    assert doc["card_mib"] == 65536


def test_text_report() -> None:
    done = scan(str(FIXTURES / "ms_cpu_oom.log"))
    assert done.returncode == 0, done.stderr
    assert "actual peak MiB" in done.stdout
    assert "OOM (device_oom, activation)" in done.stdout


def test_nothing_found_exits_3(tmp_path: Path) -> None:
    log = tmp_path / "quiet.log"
    log.write_text("[WARNING] ME(1,2,python):2025 [a.cc:1] f] nothing to see\n")
    done = scan(str(log))
    assert done.returncode == 3
    assert "GLOG_v=1" in done.stderr


def test_missing_path_exits_2(tmp_path: Path) -> None:
    done = scan(str(tmp_path / "absent.log"))
    assert done.returncode == 2
    assert "absent.log" in done.stderr


def test_a_folder_walk_leaves_documents_and_records_out(tmp_path: Path) -> None:
    """A run folder or a log folder with a README: only the logs are read."""
    oom = (FIXTURES / "ms_cpu_oom.log").read_text()
    (tmp_path / "README.md").write_text("An example of what to look for:\n" + oom)
    (tmp_path / "report.json").write_text(json.dumps({"tail": oom}))
    shutil.copy(FIXTURES / "ms_cpu_exit.log", tmp_path / "server.log")
    done = scan(str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["oom"] == []
    assert doc["worst_actual_peak_mib"] is not None
    assert [Path(f).name for f in doc["files"]] == ["server.log"]
    # Named on its own, a file is read whatever its name.
    named = json.loads(scan(str(tmp_path / "README.md"), "--json").stdout)
    assert len(named["oom"]) == 1
