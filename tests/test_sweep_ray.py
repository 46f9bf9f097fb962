"""`pretuner sweep --ray-address` on a real local Ray cluster: two nodes of two emulated CUDA
GPUs each (every node its own emulated card), five tunings as Ray tasks, two of them failing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import FAST_SIM, cli_env, default_sigint, require, run_cli, wait_for
from tests.test_ray_multinode import _environ

ray = require("ray", "PRETUNER_RAY_REQUIRED")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.ray, pytest.mark.slow,
              pytest.mark.xdist_group("ray-cluster")]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("PRETUNER_SIM_") and k != "RAY_ADDRESS"}
    cards = [tmp_path_factory.mktemp(f"card-{n}") for n in ("head", "worker")]
    args = {"num_cpus": 1, "num_gpus": 2, "include_dashboard": False}
    with _environ({**base, **FAST_SIM, "PRETUNER_SIM_STATE_DIR": str(cards[0])}):
        c = Cluster(initialize_head=True, head_node_args=args)
    try:
        with _environ({**base, **FAST_SIM, "PRETUNER_SIM_STATE_DIR": str(cards[1])}):
            c.add_node(num_cpus=1, num_gpus=2)
        yield str(c.address)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


V1 = "model: qwen3-8b, engine: vllm, emulate: true, max-model-len: 4096, max-num-seqs: 8"
SWEEP = f"""\
- {{name: a80, card: 80, {V1}}}
- {{name: b40, card: 40, {V1}}}
- {{name: c80-tp2, card: 80, tp: 2, {V1}}}
- {{name: too-big, card: 80, tp: 4, {V1}}}
- {{name: no-fit, card: 40, tp: 1, {V1.replace("qwen3-8b", "qwen3-32b")}}}
"""


def test_tunings_as_ray_tasks_some_failing(gpu_cluster: str, tmp_path: Path) -> None:
    """Every tuning holds its layout's GPUs on one node; the one no node can hold fails alone,
    with its exit code and reason, and the three others are validated in their own folders."""
    (tmp_path / "s.yaml").write_text(SWEEP)
    proc = run_cli("sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "sw"),
                   "--ray-address", gpu_cluster, "--json", env=cli_env(), timeout=400)
    assert proc.returncode == 10, proc.stderr
    doc = json.loads(proc.stdout)
    rows = {r["name"]: r for r in doc["tunings"]}
    assert rows["too-big"]["exit_code"] == 7  # refused by the scheduler, not run
    # Run in its task, refused there: its exit code and the run's own one-line reason.
    assert rows["no-fit"]["exit_code"] == 4
    assert rows["no-fit"]["reason"].startswith("TP1 x PP1: qwen3-32b's weights take 61.02 GiB")
    assert rows["too-big"]["reason"] == ("needs 4 GPU on one node; the largest node of the Ray "
                                         "cluster has 2")
    for name in ("a80", "b40", "c80-tp2"):
        rep = json.loads((tmp_path / "sw" / name / "report.json").read_text())
        assert rows[name]["outcome"] == "validated", rows[name]
        assert rep["validated"] is True
        assert rows[name]["kv_mib"] == rep["derivation"]["kv_cache_memory_bytes"] // 2**20
        assert rows[name]["card_gib"] == rep["card_gib"]
    assert json.loads((tmp_path / "sw" / "c80-tp2" / "report.json").read_text())["tp"] == 2
    # One line per start and finish; four GPUs hold three tunings (1 + 1 + 2) at once: Ray gave
    # each task its own GPUs (two on one emulated node read the card's busy memory otherwise).
    lines = [line.split("]", 1)[1].split() for line in proc.stderr.splitlines()
             if line.startswith("[")]
    events = [words[0] for words in lines]
    assert events.count("start") == 4
    assert events.count("finish") == 5
    first_validated = next(i for i, words in enumerate(lines) if words[2] == "validated")
    assert events[:first_validated].count("start") >= 3, proc.stderr
    assert len(doc["presets"]) == 3


def test_ctrl_c_cancels_the_running_tasks_and_their_servers(gpu_cluster: str,
                                                             tmp_path: Path) -> None:
    """Ctrl-C: every running task stops its tuning (which stops its server) before the sweep
    exits 130; no process of the sweep's tunings is left on the node."""
    (tmp_path / "s.yaml").write_text("".join(
        f"- {{name: t{n}, card: 80, {V1}}}\n" for n in range(2)))
    sw, err = tmp_path / "sw", tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretuner", "sweep", str(tmp_path / "s.yaml"), "--out",
             str(sw), "--ray-address", gpu_cluster], env=cli_env(), stdout=subprocess.DEVNULL,
            stderr=stderr, stdin=subprocess.DEVNULL, preexec_fn=default_sigint)  # noqa: S603, PLW1509
        try:
            for n in range(2):
                wait_for(err, f"start  t{n}", timeout=120)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=240) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "stopping 2 tuning(s)" in err.read_text()
    assert _using(sw) == []
    doc = json.loads((sw / "summary.json").read_text())
    assert {r["outcome"] for r in doc["tunings"]} <= {"interrupted", "not run"}


def _using(folder: Path) -> list[str]:
    """Every process naming `folder` on its command line or holding a file under it open (a
    server writes its log there): the sweep's tunings and their servers."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            files = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if str(folder) in cmdline or any(f.startswith(str(folder)) for f in files):
            found.append(cmdline)
    return found
