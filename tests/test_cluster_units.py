"""Multi-node logic without Ray: placement, node variables, versions, the restart commands, and
merging the nodes' per-rank figures (on real MindSpore-format logs written to tmp folders)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pretuner.cluster.collect import (
    NodeScan,
    merge_node_scans,
    missing_ranks,
    scan_node_folder,
)
from pretuner.cluster.env import (
    JOB_CONFIG_ENV,
    NODE_VARS,
    NodeProbe,
    describe_problems,
    env_problems,
    job_config_env,
    node_exports,
    proposed_envs,
    restart_commands,
)
from pretuner.cluster.nodefs import NODE_ROOT_ENV, node_local
from pretuner.cluster.nodes import NodeFacts, Placement, check_versions, place, survey
from pretuner.errors import ClusterError, ExitCode
from pretuner.sim.logs import PoolStats, RankLog
from pretuner.units import MIB

HEAD = NodeFacts("a" * 56, "10.0.0.1", True, 8, local=True, head=True)
WORKER = NodeFacts("b" * 56, "10.0.0.2", True, 8)
DEAD = NodeFacts("c" * 56, "10.0.0.3", False, 8)
GOOD_ENV = {
    "GLOO_SOCKET_IFNAME": "eth0",
    "HCCL_SOCKET_IFNAME": "eth0",
    "TP_SOCKET_IFNAME": "eth0",
    "MS_ENABLE_LCCL": "off",
    "HCCL_OP_EXPANSION_MODE": "AIV",
    "MS_ALLOC_CONF": "enable_vmm:true",
    "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}


# -- placement --------------------------------------------------------------------------------
def test_place_fills_this_node_first() -> None:
    p = place([WORKER, HEAD], 16)
    assert p.nodes == (HEAD, WORKER)
    assert p.ranks_per_node == (8, 8)
    assert p.world == 16
    assert p.node_of_rank(7) == HEAD
    assert p.node_of_rank(8) == WORKER
    assert "ranks 8-15" in p.describe()


def test_place_single_node_uses_only_this_one() -> None:
    p = place([WORKER, HEAD], 8)
    assert p.nodes == (HEAD,)


def test_place_refuses_too_few_npus_and_names_the_dead_node() -> None:
    with pytest.raises(ClusterError) as err:
        place([HEAD, WORKER, DEAD], 24)
    msg = str(err.value)
    assert "24 ranks need 24 NPUs and the Ray cluster has 16" in msg
    assert "10.0.0.3 (cccccccc) dead" in msg
    assert "ray start --address" in msg
    assert err.value.exit_code is ExitCode.CLUSTER


def test_place_ignores_a_dead_node_when_the_others_suffice() -> None:
    assert place([HEAD, WORKER, DEAD], 16).nodes == (HEAD, WORKER)


def test_place_refuses_busy_npus() -> None:
    with pytest.raises(ClusterError, match="16 free NPUs and Ray has 8 free of 16"):
        place([HEAD, WORKER], 16, free_npus=8)


def test_place_needs_npus_on_this_node() -> None:
    bare = NodeFacts("d" * 56, "10.0.0.9", True, 0, local=True)
    with pytest.raises(ClusterError, match="this node 10.0.0.9 .* has no NPU"):
        place([bare, WORKER, NodeFacts("e" * 56, "10.0.0.4", True, 8)], 16)


def test_place_needs_this_machine_in_the_cluster() -> None:
    with pytest.raises(ClusterError, match="not a node of the Ray cluster"):
        place([WORKER], 8)


def test_survey_lists_every_node() -> None:
    assert survey([WORKER, DEAD, HEAD]) == (
        "10.0.0.1 (aaaaaaaa) 8 NPU (this node), 10.0.0.2 (bbbbbbbb) 8 NPU, 10.0.0.3 (cccccccc) dead"
    )


# -- versions ---------------------------------------------------------------------------------
def test_versions_agree() -> None:
    check_versions("0.1.0", {"n1": "0.1.0", "n2": "0.1.0"})


def test_version_mismatch_is_refused_with_the_fix() -> None:
    with pytest.raises(ClusterError) as err:
        check_versions("0.1.0", {"10.0.0.1 (aaaaaaaa)": "0.1.0", "10.0.0.2 (bbbbbbbb)": "0.0.9"})
    assert "node 10.0.0.2 (bbbbbbbb) has 0.0.9; this node has pretuner 0.1.0" in str(err.value)
    assert "install pretuner 0.1.0 on every node" in str(err.value)


def test_pretuner_missing_on_a_node() -> None:
    with pytest.raises(ClusterError, match="not importable by Ray workers on node n2"):
        check_versions("0.1.0", {"n1": "0.1.0", "n2": None})


# -- node variables ---------------------------------------------------------------------------
def _probe(
    node: NodeFacts, env: dict[str, str], nics: tuple[str, ...] = ("lo", "eth0")
) -> NodeProbe:
    return NodeProbe(node, "0.1.0", env, nics, address_nic="eth0")


PLACED = Placement((HEAD, WORKER), (8, 8))


def test_good_environment_has_no_problem() -> None:
    assert env_problems([_probe(HEAD, GOOD_ENV), _probe(WORKER, GOOD_ENV)], PLACED) == []


def test_node_exports_match_the_guide() -> None:
    assert node_exports("eth0", 8) == GOOD_ENV
    assert [v.name for v in NODE_VARS if v.required] == list(GOOD_ENV)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"GLOO_SOCKET_IFNAME": None}, "10.0.0.2 (bbbbbbbb) lacks GLOO_SOCKET_IFNAME"),
        ({"HCCL_SOCKET_IFNAME": "eth9"},
         "10.0.0.2 (bbbbbbbb) HCCL_SOCKET_IFNAME=eth9 names no network interface of it"),
        ({"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"},
         "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 lists fewer than its 8 ranks"),
        ({"ASCEND_RT_VISIBLE_DEVICES": "all"}, "ASCEND_RT_VISIBLE_DEVICES=all lists fewer"),
        ({"MS_ALLOC_CONF": "enable_vmm:false"},
         "10.0.0.2 (bbbbbbbb) MS_ALLOC_CONF=enable_vmm:false differs from another node's"),
    ],
)  # fmt: skip
def test_node_variable_problems(change: dict[str, str | None], expected: str) -> None:
    env = {**GOOD_ENV, **change}
    worker_env = {k: v for k, v in env.items() if v is not None}
    problems = env_problems([_probe(HEAD, GOOD_ENV), _probe(WORKER, worker_env)], PLACED)
    assert expected in describe_problems(problems)


def test_optional_backend_must_agree_when_set() -> None:
    head = {**GOOD_ENV, "vLLM_MODEL_BACKEND": "MindFormers"}
    worker = {**GOOD_ENV, "vLLM_MODEL_BACKEND": "MindSpore"}
    problems = env_problems([_probe(HEAD, head), _probe(WORKER, worker)], PLACED)
    assert {p.name for p in problems} == {"vLLM_MODEL_BACKEND"}
    ok = env_problems([_probe(HEAD, head), _probe(WORKER, GOOD_ENV)], PLACED)
    assert ok == []  # optional: one node without it is not a problem


def test_proposed_envs_keep_what_is_right_and_fix_the_rest() -> None:
    head = {**GOOD_ENV, "MS_ALLOC_CONF": "enable_vmm:false", "GLOO_SOCKET_IFNAME": "ib0"}
    probes = [
        NodeProbe(HEAD, "0.1.0", head, ("lo", "ib0", "eth0"), "eth0"),
        NodeProbe(WORKER, "0.1.0", {NODE_ROOT_ENV: "/tmp/n1"}, ("lo", "enp1"), None),
    ]
    envs = proposed_envs(probes, PLACED)
    assert envs[HEAD.node_id]["GLOO_SOCKET_IFNAME"] == "ib0"  # its own, and it exists
    assert envs[HEAD.node_id]["HCCL_SOCKET_IFNAME"] == "eth0"  # the NIC of its Ray address
    assert envs[WORKER.node_id]["HCCL_SOCKET_IFNAME"] == "enp1"  # its only real NIC
    # the guide's value wins where nodes must agree and one node has it
    assert envs[HEAD.node_id]["MS_ALLOC_CONF"] == envs[WORKER.node_id]["MS_ALLOC_CONF"]
    assert envs[WORKER.node_id]["MS_ENABLE_LCCL"] == "off"
    assert envs[WORKER.node_id]["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert envs[WORKER.node_id][NODE_ROOT_ENV] == "/tmp/n1"
    assert "vLLM_MODEL_BACKEND" not in envs[WORKER.node_id]  # optional, nobody has it


def test_restart_commands_exact_text() -> None:
    probes = [_probe(WORKER, {}), _probe(HEAD, GOOD_ENV)]
    envs = {HEAD.node_id: {"A": "1"}, WORKER.node_id: {"A": "1", "B": "x y"}}
    text = restart_commands(
        probes, envs, head_host="10.0.0.1", port=6379,
        extra_args={WORKER.node_id: ['--resources={"NPU": 8}']},
    )  # fmt: skip
    assert text == (
        "# 1. on every node: ray stop\n"
        "# 2. on 10.0.0.1 (aaaaaaaa) (head: start it first):\n"
        "export A=1\n"
        "ray start --head --port=6379\n"
        "# 3. on 10.0.0.2 (bbbbbbbb):\n"
        "export A=1\n"
        "export B='x y'\n"
        "ray start --address=10.0.0.1:6379 '--resources={\"NPU\": 8}'\n"
    )
    script = 'ray() { echo ray "$@"; }\n' + text
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "ray start --head --port=6379",
        'ray start --address=10.0.0.1:6379 --resources={"NPU": 8}',
    ]


def test_job_config_env_is_what_ray_reads() -> None:
    env = job_config_env({"GLOG_v": "1", "vLLM_MODEL_MEMORY_USE_GB": "46"})
    assert json.loads(env[JOB_CONFIG_ENV]) == {
        "runtime_env": {"env_vars": {"GLOG_v": "1", "vLLM_MODEL_MEMORY_USE_GB": "46"}}
    }


def test_node_local_paths() -> None:
    assert node_local("/runs/x/glog", {}) == Path("/runs/x/glog")
    assert node_local("/runs/x/glog", {NODE_ROOT_ENV: "/tmp/node1"}) == Path(
        "/tmp/node1/runs/x/glog"
    )


# -- gathering --------------------------------------------------------------------------------
def _write_rank(folder: Path, rank: int, peak_mib: int, pid: int, oom: bool = False) -> None:
    log = RankLog(rank, pid, 0x7F0000000040, folder)
    log.adapter_init(65536, 61457 * MIB, 57 * 1024 * MIB, 57.6)
    if oom:
        log.log(
            "ERROR",
            "DEVICE",
            "op_runner.cc:585",
            "MallocForKernelOutput",
            "#umsg#Memory not enough:#umsg#Device(id:4) memory isn't enough and alloc "
            "failed, kernel name: FlashAttentionScore-op0, alloc size: 4160306688B.",
        )
    stats = PoolStats(40000 * MIB, peak_mib * MIB - MIB, peak_mib * MIB, 60 * 1024 * MIB)
    log.pool_dump(stats, "2.5")
    log.close()


@pytest.fixture
def two_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("GLOG_v", "1")
    head, worker = tmp_path / "head", tmp_path / "worker"
    for rank in range(4):
        _write_rank(head, rank, 47000 + rank, 100 + rank)
        _write_rank(worker, rank + 4, 47100 + rank, 200 + rank, oom=rank == 2)
    return head, worker


def _node_scan(folder: Path, node: NodeFacts) -> NodeScan:
    wire = pickle.dumps(scan_node_folder(str(folder), node.node_id, node.label))
    scan: NodeScan = pickle.loads(wire)  # noqa: S301 - what crosses Ray: a pickle
    return scan


def test_merge_takes_the_worst_rank_from_the_node_it_ran_on(two_nodes: tuple[Path, Path]) -> None:
    head, worker = two_nodes
    merged = merge_node_scans([_node_scan(head, HEAD), _node_scan(worker, WORKER)])
    scan = merged.scan
    assert scan.worst is not None
    assert (scan.worst.rank, scan.worst.actual_peak_mib) == (7, 47103)
    assert merged.worst_node == WORKER.label
    assert merged.rank_peaks_mib == {
        **{f"rank{r}": 47000 + r for r in range(4)},
        **{f"rank{r + 4}": 47100 + r for r in range(4)},
    }
    assert merged.doc["rank_nodes"]["rank0"] == HEAD.label
    assert merged.doc["rank_nodes"]["rank6"] == WORKER.label
    assert [(o.rank, o.event.alloc_bytes) for o in scan.oom] == [(6, 4160306688)]
    assert merged.init_free_mib == (61457,) * 8
    assert missing_ranks(merged, 8) == []
    assert missing_ranks(merged, 10) == [8, 9]
    doc = merged.doc
    assert doc["worst_node"] == WORKER.label
    assert [n["ranks"] for n in doc["nodes"]] == [4, 4]
    json.dumps(doc)


def test_merge_counts_a_shared_disk_once(two_nodes: tuple[Path, Path]) -> None:
    head, _ = two_nodes
    merged = merge_node_scans([_node_scan(head, HEAD), _node_scan(head, WORKER)])
    assert len(merged.scan.ranks) == 4
    assert set(merged.doc["rank_nodes"].values()) == {HEAD.label}


def test_merge_keeps_repeated_rank_numbers_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOG_v", "1")
    _write_rank(tmp_path / "a", 0, 47000, 100)
    _write_rank(tmp_path / "b", 0, 48000, 200)  # per-node rank numbering
    merged = merge_node_scans(
        [_node_scan(tmp_path / "a", HEAD), _node_scan(tmp_path / "b", WORKER)]
    )
    assert merged.rank_peaks_mib == {f"{HEAD.label}/rank0": 47000, f"{WORKER.label}/rank0": 48000}
    assert merged.worst_node == WORKER.label


def test_a_node_without_the_folder_reports_nothing(tmp_path: Path) -> None:
    scan = _node_scan(tmp_path / "absent", WORKER)
    assert not scan.found
    assert scan.scan.ranks == ()


def test_node_scan_reads_under_the_node_root(
    two_nodes: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    head, _ = two_nodes
    monkeypatch.setenv(NODE_ROOT_ENV, str(head))
    scan = _node_scan(Path("/"), WORKER)  # "/" on that node is `head` here
    assert scan.folder == str(head)
    assert len(scan.scan.ranks) == 4


# -- Ray stays optional -----------------------------------------------------------------------
@pytest.mark.slow
def test_importing_pretuner_never_imports_ray() -> None:
    code = (
        "import sys\n"
        "import pretuner.cli.app, pretuner.cli.run, pretuner.tune.entry, pretuner.sim.serve\n"
        "import pretuner.cluster.session, pretuner.sim.raynodes\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ray_address_without_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from pretuner.cluster.ray_api import RayCluster
    from pretuner.errors import BadInputError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(BadInputError, match="needs Ray, which is not installed") as err:
        RayCluster.connect("auto")
    assert "pretuner[ray]" in str(err.value)


# -- the emulated server's Ray options --------------------------------------------------------
def test_sim_places_on_ray_like_vllm() -> None:
    from pretuner.sim.r01_config import parse

    env = {"RAY_ADDRESS": "10.0.0.1:6379"}
    assert parse(["--model", "m"], env).ray_address is None  # mp backend: Ray not used
    ray_backend = ["--model", "m", "--distributed-executor-backend", "ray"]
    assert parse(ray_backend, env).ray_address == "10.0.0.1:6379"
    assert parse(ray_backend, {}).ray_address is None  # in-process nodes, as before
    assert parse(["--model", "m", "--sim-ray-address", "h:1"], {}).ray_address == "h:1"


def test_sim_rank_skew() -> None:
    from pretuner.sim.r01_config import UsageError, parse

    assert parse(["--model", "m", "--sim-rank-skew", "12=1.5, 3=2"], {}).rank_skew == {
        12: 1.5,
        3: 2.0,
    }
    assert parse(["--model", "m"], {"PRETUNER_SIM_RANK_SKEW": "1=3"}).rank_skew == {1: 3.0}
    for bad in ("12", "x=1", "3=0", "3=-1"):
        with pytest.raises(UsageError, match="rank skew"):
            parse(["--model", "m", "--sim-rank-skew", bad], {})


def test_ray_address_is_checked_before_ray_waits_on_it() -> None:
    import socket

    from pretuner.cluster.ray_api import check_address
    from pretuner.errors import BadInputError

    check_address("auto")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_address(f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match=f"cannot reach the Ray head at 127.0.0.1:{port}"):
        check_address(f"127.0.0.1:{port}")  # nobody listens there any more
    with pytest.raises(BadInputError, match="Ray Client addresses are not supported"):
        check_address("ray://10.0.0.1:10001")
    with pytest.raises(BadInputError, match="is not HOST:PORT"):
        check_address("10.0.0.1")


# -- V1 engines on Ray: GPUs, and every node's device peaks -----------------------------------
def test_place_counts_the_engines_resource() -> None:
    """A CUDA engine's ranks hold Ray's `GPU`: a refusal counts and names GPUs, not NPUs."""
    with pytest.raises(ClusterError) as err:
        place([HEAD, WORKER, DEAD], 24, unit="GPU")
    assert "24 ranks need 24 GPUs and the Ray cluster has 16" in str(err.value)
    assert "10.0.0.1 (aaaaaaaa) 8 GPU (this node)" in str(err.value)


def test_merged_sampling_is_the_worst_device_of_any_node() -> None:
    """The pinned KV is per device: each phase's peak is the worst device on any node, the
    total the smallest device's, and every node's own peak is kept for the report."""
    from pretuner.cluster.sampling import merge_sampled
    from pretuner.launch.sampler import Sampled

    head = Sampled("emulated", {"loading": 70_000, "load": 71_000}, 10, None, 81_559,
                   last_mib={"load": 69_000})
    worker = Sampled("emulated", {"loading": 72_500, "load": 70_500}, 12, None, 81_500,
                     last_mib={"load": 69_500})
    merged = merge_sampled([("head", head), ("worker", worker)])
    assert merged.peaks_mib == {"loading": 72_500, "load": 71_000}
    assert merged.last_mib == {"load": 69_500}
    assert merged.node_peaks_mib == {"head": 71_000, "worker": 72_500}
    assert (merged.total_mib, merged.samples, merged.failure) == (81_500, 22, None)


def test_a_node_peak_names_the_worst_node_of_a_launch() -> None:
    """A V1 launch has no rank dumps: its worst node is the node of the worst device."""
    from pretuner.engines.base import LaunchSettings, Purpose
    from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
    from pretuner.launch.sampler import Sampled
    from pretuner.tune.execute import with_samples

    settings = LaunchSettings(Purpose.VALIDATE, 80, 0.9, 0, 8192, 64, 8192, 16, 16)
    outcome = LaunchOutcome(1, settings, OutcomeKind.OK, None, {}, None, 1, 1, 1.0, 1.0, 1.0,
                            3.0, 0.0, "server.log")
    sampled = Sampled("emulated", {"load": 72_500}, node_peaks_mib={"head": 70_000,
                                                                    "worker": 72_500})
    got = with_samples(outcome, sampled)
    assert (got.worst_node, got.node_peaks_mib) == ("worker", sampled.node_peaks_mib)


def test_a_v1_layout_spans_nodes_only_on_a_ray_cluster() -> None:
    """TP8 x PP2 of 80 GB cards is two nodes: refused on one machine (exit 2, the fix
    named), planned with --ray-address (nothing is connected to before a launch)."""
    from pretuner.errors import BadInputError
    from pretuner.tune.entry import dry_run
    from pretuner.tune.options import RunOptions

    opts = RunOptions(model="deepseek-v3", engine="vllm", emulate=True, card_gib=80, tp=8, pp=2)
    with pytest.raises(BadInputError, match="TP8 x PP2 spans 2 node"):
        dry_run(opts)
    d = dry_run(replace(opts, ray_address="10.0.0.1:6379"))
    argv = d.command.argv
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
