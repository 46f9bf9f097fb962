"""Multi-node pre-runs on a real local Ray cluster: a head and a worker node on this machine,
8 emulated NPUs each, every node with its own log disk (the worker's under a folder that stands
in for its disk), DeepSeek-V3 TP16 tuned end to end on the emulated card."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers import FAST_SIM, cli_env, require, run_cli

ray = require("ray", "PRETUNER_RAY_REQUIRED")
from ray.cluster_utils import Cluster  # noqa: E402

from pretuner.cluster.env import job_config_env  # noqa: E402
from pretuner.cluster.nodefs import NODE_ROOT_ENV  # noqa: E402
from pretuner.logscan import scan_paths  # noqa: E402
from pretuner.logscan.events import Located  # noqa: E402

# One worker runs this file: its tests share the module's Ray cluster.
pytestmark = [pytest.mark.engine, pytest.mark.ray, pytest.mark.slow,
              pytest.mark.xdist_group("ray-cluster")]

# What every node exports before `ray start` (REFERENCE section 7), with this machine's NIC.
NODE_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "HCCL_SOCKET_IFNAME": "lo",
    "TP_SOCKET_IFNAME": "lo",
    "MS_ENABLE_LCCL": "off",
    "HCCL_OP_EXPANSION_MODE": "AIV",
    "MS_ALLOC_CONF": "enable_vmm:true",
    "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}
READY_RE = re.compile(r"Uvicorn running on http://[\d.]+:(\d+)")


@dataclass
class LocalCluster:
    cluster: Any
    address: str
    worker_root: Path  # the worker node's "disk"
    head_label: str
    worker_label: str

    def on_worker(self, path: Path) -> Path:
        return self.worker_root / path.resolve().relative_to("/")


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ exactly `env` while a node starts: a raylet inherits its starter's env."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _base_env() -> dict[str, str]:
    skip = (*NODE_ENV, NODE_ROOT_ENV, "RAY_ADDRESS")
    return {k: v for k, v in os.environ.items() if k not in skip}


def _label(node: Any) -> str:
    return f"{node.node_ip_address} ({node.node_id[:8]})"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("worker-disk")
    node_args = {"num_cpus": 1, "resources": {"NPU": 8}, "include_dashboard": False}
    with _environ({**_base_env(), **NODE_ENV}):
        c = Cluster(initialize_head=True, head_node_args=node_args)
    try:
        with _environ({**_base_env(), **NODE_ENV, NODE_ROOT_ENV: str(root)}):
            worker = c.add_node(num_cpus=1, resources={"NPU": 8})
        yield LocalCluster(c, c.address, root, _label(c.head_node), _label(worker))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.fixture
def driver(cluster: LocalCluster) -> Iterator[None]:
    """This test process as a Ray driver (to kill an actor, read free resources)."""
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def _tune(cluster: LocalCluster, out: Path, *args: str, **env: str) -> dict[str, Any]:
    proc = run_cli(
        "run", "--model", "deepseek-v3", "--card", "64", "--ray-address", cluster.address,
        "--out", str(out), "--json", "--stop-grace", "60", *args,
        env=cli_env(**env),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep: dict[str, Any] = json.loads(proc.stdout)
    return rep


def _scan(out: Path, n: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / f"launch-{n}" / "scan.json").read_text())
    return doc


def _ranks_in(folder: Path) -> set[int]:
    return {int(p.name.split("_")[1]) for p in folder.glob("rank_*")}


def test_deepseek_v3_tp16_two_nodes_worst_rank_on_the_second_node(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # Seed 3: the emulated ranks' spread puts the worst one (rank 14) on the worker node.
    rep = _tune(cluster, out, "--seed", "3")
    assert rep["validated"] is True
    assert (rep["tp"], rep["nodes"], rep["launches"]) == (16, 2, 2)
    assert [(n["node"], n["ranks"]) for n in rep["cluster"]["nodes"]] == [
        (cluster.head_label, 8),
        (cluster.worker_label, 8),
    ]
    for step in rep["steps"]:
        assert step["worst_node"] == cluster.worker_label
        assert len(step["rank_peaks_mib"]) == 16
    prerun = _scan(out, 1)
    assert prerun["worst_rank"] == 14
    assert prerun["worst_node"] == cluster.worker_label
    # Each rank's log lies on its own node only; the head alone would miss the worst one.
    head_glog = out / "launch-1" / "glog"
    assert _ranks_in(head_glog) == set(range(8))
    assert _ranks_in(cluster.on_worker(head_glog)) == set(range(8, 16))
    head_only = scan_paths([head_glog]).worst
    assert head_only is not None
    assert head_only.actual_peak_mib is not None
    assert head_only.actual_peak_mib < rep["steps"][0]["worst_peak_mib"]
    assert rep["derivation"]["actual_peak_mib"] == rep["steps"][0]["worst_peak_mib"]
    # The launch's variables reached every rank through the job runtime env.
    cmd = json.loads((out / "launch-2" / "command.json").read_text())
    job = json.loads(cmd["env"]["RAY_JOB_CONFIG_JSON_ENV_VAR"])["runtime_env"]["env_vars"]
    assert job["GLOG_v"] == "1"
    assert job["vLLM_MODEL_MEMORY_USE_GB"] == rep["final"]["env"]["vLLM_MODEL_MEMORY_USE_GB"]
    assert cmd["argv"][-2:] == ["--distributed-executor-backend", "ray"]
    report_md = (out / "report.md").read_text()
    assert f"on {cluster.worker_label}" in report_md


def test_a_rank_on_the_second_node_ooms_and_the_tuner_falls_back(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # Rank 12 (worker node) needs 6x the activations: only it runs out of memory at 16k.
    rep = _tune(cluster, out, PRETUNER_SIM_RANK_SKEW="12=6")
    steps = rep["steps"]
    assert steps[0]["outcome"] == "oom_in_request"
    oom = _scan(out, 1)["oom"]
    assert (oom[0]["rank"], oom[0]["kind"]) == (12, "device_oom")
    assert {o["rank"] for o in oom} <= {12, None}  # the server may echo it without a rank
    assert oom[0]["file"].startswith(str(cluster.worker_root))
    # The whole-prompt step does not fit on rank 12: shorter prompts or smaller prefill steps.
    fallback = {d["decision"] for d in rep["decisions"]}
    assert fallback & {"shorten max_model_len", "prefill in chunks"}
    assert rep["validated"] is True
    final = rep["final"]
    assert min(final["max_model_len"], final["max_num_batched_tokens"]) < 16384
    assert {s["worst_node"] for s in steps} == {cluster.worker_label}
    assert all(_scan(out, s["n"])["worst_rank"] == 12 for s in steps)


def test_validation_oom_on_the_second_node_is_gathered(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from pretuner.cluster.session import ClusterPlan, ray_cluster
    from pretuner.engines.base import LaunchCommand, LaunchSettings, Purpose, Target
    from pretuner.engines.mindspore_r01 import SIM, R01Engine
    from pretuner.engines.outcome import OutcomeKind
    from pretuner.models import resolve
    from pretuner.tune.execute import LaunchContext, run_launch
    from pretuner.tune.record import RunRecord

    sim_env = {
        **FAST_SIM,
        "PRETUNER_SIM_STATE_DIR": str(tmp_path / "card"),
        "PRETUNER_SIM_WEIGHTS_FORMAT": resolve("deepseek-v3").weights_format(None).name,
        "PRETUNER_SIM_RANK_SKEW": "12=2",  # under full load, only rank 12 overflows
    }

    engine = R01Engine(SIM, True, None, "test", nodes=2, launch_env=sim_env)

    def build(s: LaunchSettings, port: int) -> LaunchCommand:
        return engine.command(s, Target("deepseek-v3", "deepseek-v3", "127.0.0.1", port))

    # What the tuner validates for seed 0 when it reads only the head's ranks.
    settings = LaunchSettings(Purpose.VALIDATE, 64, 0.936, 46, 16384, 12, 16384, 16, 16)
    phases: list[tuple[str, str]] = []
    plan = ClusterPlan(world=16, nodes_planned=2, emulated=True)
    with ray_cluster(cluster.address, plan, lambda p, d: phases.append((p, d))) as collectors:
        ctx = LaunchContext(
            build, "deepseek-v3", ready_timeout_s=120, stop_grace_s=60, collector=collectors
        )
        outcome = run_launch(1, settings, ctx, RunRecord(path=tmp_path), lambda p, d: None)
    assert outcome.kind is OutcomeKind.OOM_IN_REQUEST
    assert outcome.requests_ok < outcome.requests_total
    assert outcome.oom_text is not None
    assert "memory isn't enough" in outcome.oom_text
    scan = json.loads((tmp_path / "launch-1" / "scan.json").read_text())
    # rank 12's own line on its node first; the server may echo it without a rank
    assert scan["oom"][0]["rank"] == 12
    assert scan["oom"][0]["file"].startswith(str(cluster.worker_root))
    assert {o["rank"] for o in scan["oom"]} <= {12, None}
    assert scan["rank_nodes"]["rank12"] == cluster.worker_label
    assert any(p == "cluster" and "ranks 8-15" in d for p, d in phases)


def test_too_few_npus_is_refused_before_a_run_folder_exists(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = run_cli(
        "run", "--model", "deepseek-v3", "--card", "64", "--tp", "32",
        "--ray-address", cluster.address, "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr
    assert "32 ranks need 32 NPUs and the Ray cluster has 16" in proc.stderr
    assert cluster.head_label in proc.stderr
    assert cluster.worker_label in proc.stderr
    assert not out.exists()


def test_a_node_without_its_environment_then_a_dead_node(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A third node started without the exports: refused with the commands; once it is
    gone, refused as dead."""
    with _environ(_base_env()):
        third = cluster.cluster.add_node(num_cpus=1, resources={"NPU": 16})
    label = _label(third)
    args = ["run", "--model", "deepseek-v3", "--card", "64", "--tp", "32",
            "--ray-address", cluster.address, "--out", str(tmp_path / "run")]  # fmt: skip
    try:
        proc = run_cli(*args)
        assert proc.returncode == 7, proc.stderr
        err = proc.stderr
        assert f"node variables not set before `ray start`: {label} lacks GLOO_SOCKET_IFNAME" in err
        assert cluster.worker_label + " lacks" not in err  # the others are fine
        assert "pretuner cannot set them for a launch" in err
        host, port = cluster.address.rsplit(":", 1)
        assert "# 1. on every node: ray stop\n" in err
        assert "(head: start it first):\nexport GLOO_SOCKET_IFNAME=lo\n" in err
        assert f"ray start --head --port={port} '--resources={{\"NPU\": 8}}'\n" in err
        block = err[err.index(f"on {label}:") :]
        assert "export MS_ALLOC_CONF=enable_vmm:true\n" in block
        assert f"ray start --address={host}:{port} '--resources={{\"NPU\": 16}}'" in block
        assert not (tmp_path / "run").exists()
    finally:
        cluster.cluster.remove_node(third)
    deadline = time.monotonic() + 30
    while True:
        proc = run_cli(*args)
        if f"{label} dead" in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert proc.returncode == 7, proc.stderr
    assert "32 ranks need 32 NPUs and the Ray cluster has 16" in proc.stderr
    assert f"{label} dead" in proc.stderr


def _start_sim(
    cluster: LocalCluster, tmp_path: Path, glog: Path
) -> tuple[subprocess.Popen[bytes], Path, str]:
    launch = {
        "GLOG_v": "1", "GLOG_logtostderr": "0", "GLOG_log_dir": str(glog),
        "ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "50",
    }  # fmt: skip
    env = {
        **cli_env(),
        **launch,
        **job_config_env(launch),
        "RAY_ADDRESS": cluster.address,
        "PRETUNER_SIM_WEIGHTS_FORMAT": "w8a8",
    }
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-m", "pretuner.sim", "serve", "--model", "deepseek-v3",
            "--tensor-parallel-size", "16", "--distributed-executor-backend", "ray",
            "--max-model-len", "16384", "--max-num-batched-tokens", "16384",
            "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        match = READY_RE.search(log_path.read_text(errors="replace"))
        if match:
            return proc, log_path, f"http://127.0.0.1:{match.group(1)}"
        assert proc.poll() is None, log_path.read_text()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the emulated server never became ready:\n" + log_path.read_text())


def _npus_free() -> int:
    return int(ray.available_resources().get("NPU", 0))


def test_sim_server_stops_through_ray_and_writes_each_dump_on_its_node(
    cluster: LocalCluster, tmp_path: Path, driver: None
) -> None:
    glog = tmp_path / "glog"
    proc, log_path, url = _start_sim(cluster, tmp_path, glog)
    try:
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        assert _npus_free() == 0  # the ranks hold both nodes' NPUs
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for folder, ranks in ((glog, range(8)), (cluster.on_worker(glog), range(8, 16))):
        scan = scan_paths([folder])
        assert Counter(r.rank for r in scan.ranks if r.actual_peak_mib) == Counter(ranks)
    deadline = time.monotonic() + 30
    while _npus_free() < 16 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _npus_free() == 16  # the actors were killed through Ray


def test_sim_server_health_fails_when_a_node_actor_dies(
    cluster: LocalCluster, tmp_path: Path, driver: None
) -> None:
    from pretuner.sim.raynodes import NAMESPACE, agent_name

    proc, log_path, url = _start_sim(cluster, tmp_path, tmp_path / "glog")
    try:
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        ray.kill(ray.get_actor(agent_name(proc.pid, 1), namespace=NAMESPACE))
        seen: int | str = 200
        deadline = time.monotonic() + 30
        while seen == 200 and time.monotonic() < deadline:
            try:
                seen = requests.get(f"{url}/health", timeout=5).status_code
            except requests.ConnectionError:
                seen = "closed"  # already gone: it exits once it has failed
            time.sleep(0.05)
        assert seen in (500, "closed")
        assert proc.wait(timeout=60) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "At least one Worker is dead. Dead Workers: node " + cluster.worker_label in (
        log_path.read_text()
    )


def test_live_poll_reports_an_oom_written_on_the_second_node(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pretuner.cluster import session as collector_module
    from pretuner.cluster.session import ClusterPlan, ray_cluster
    from pretuner.logscan.events import OomEvent
    from pretuner.sim.logs import RankLog

    monkeypatch.setattr(collector_module, "POLL_EVERY_S", 0.2)
    monkeypatch.setenv("GLOG_v", "1")
    folder = tmp_path / "launch-1"
    folder.mkdir()
    plan = ClusterPlan(world=16, nodes_planned=2, emulated=True)
    with ray_cluster(cluster.address, plan, lambda p, d: None) as collectors:
        collector = collectors(folder, folder / "server.log")
        log = RankLog(12, 4242, 0x7F0000000040, cluster.on_worker(collector.log_dir))
        log.log(
            "ERROR", "DEVICE", "op_runner.cc:585", "MallocForKernelOutput",
            "#umsg#Memory not enough:#umsg#Device(id:4) memory isn't enough and alloc failed, "
            "kernel name: FlashAttentionScore-op0, alloc size: 4160306688B.",
        )  # fmt: skip
        log.close()
        events: list[Located] = []
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            events = collector.poll()
            time.sleep(0.1)
        assert [(e.rank, type(e.event)) for e in events] == [(12, OomEvent)]
        assert events[0].file.startswith(str(cluster.worker_root))
        time.sleep(1)
        assert collector.poll() + collector.poll() == []  # reported once
