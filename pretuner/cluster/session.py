"""A run on a Ray cluster: connect, check that the layout can run there, and gather every
launch's logs through Ray (every rank writes on its own node, a task pinned to each node scans
that node's folder, and the head merges the per-rank figures)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pretuner import __version__
from pretuner.cluster.collect import NodeScan, merge_node_scans, missing_ranks, scan_node_folder
from pretuner.cluster.env import (
    describe_problems,
    env_problems,
    job_config_env,
    proposed_envs,
    restart_commands,
)
from pretuner.cluster.nodes import Placement, check_versions, place, survey
from pretuner.cluster.ray_api import TASK_TIMEOUT_S, RayCluster
from pretuner.cluster.sampling import NodeSamplers
from pretuner.devices.base import DeviceReader
from pretuner.engines.base import Phase
from pretuner.errors import ClusterError
from pretuner.launch.collect import CollectedScan, LocalCollector
from pretuner.launch.command import LaunchCommand
from pretuner.logscan import scan_paths
from pretuner.logscan.events import Located

LOG_SUBDIR = "glog"  # GLOG_log_dir under the launch folder, on every node's own disk
POLL_EVERY_S = 5.0  # how often the nodes are asked for OOM lines while the server runs


class RayCollector(LocalCollector):
    """One launch's logs on every node of the placement (server.log followed on this one)."""

    def __init__(self, cluster: RayCluster, placement: Placement, folder: Path,
                 log_path: Path, device_kind: str | None = None) -> None:
        super().__init__(folder, log_path)
        self.cluster = cluster
        self.placement = placement
        self.device_kind = device_kind  # None: the devices are read on this node only
        self._launch_env: dict[str, str] = {}
        self.nodes = placement.nodes
        self.log_dir = folder.resolve() / LOG_SUBDIR
        self._pending: list[Any] = []
        self._last_poll = 0.0
        self._oom_seen: set[tuple[str, int]] = set()

    def prepare(self, cmd: LaunchCommand) -> LaunchCommand:
        """Ranks log to files on their own node, and every rank gets the launch's variables."""
        self._launch_env = dict(cmd.env)  # what a node's device reader also reads (the card)
        launch_env = {**cmd.env, "GLOG_logtostderr": "0", "GLOG_log_dir": str(self.log_dir)}
        env = {**launch_env, **job_config_env(launch_env), "RAY_ADDRESS": self.cluster.gcs_address}
        argv = list(cmd.argv)
        if "--distributed-executor-backend" not in argv:
            argv += ["--distributed-executor-backend", "ray"]
        return replace(cmd, argv=argv, env=env)  # the bearer stays

    def sampler(self, reader: DeviceReader | None, status: Phase) -> Any:
        """Every node's devices, each read where it is (`pretuner.cluster.sampling`)."""
        if reader is None or self.device_kind is None:
            return super().sampler(reader, status)
        return NodeSamplers(self.cluster, self.placement, self.device_kind, self._launch_env,
                            status)

    def poll(self, *, final: bool = False) -> list[Located]:
        """server.log on this node, plus OOM lines found on any node (asked every few s)."""
        events = super().poll(final=final)
        if final:
            return events
        now = time.monotonic()
        if self._pending and self.cluster.ready(self._pending):
            results = self.cluster.gather(self._pending, self.nodes, "the OOM poll", 1.0)
            self._pending = []
            events += self._new_oom(results)
        if not self._pending and now - self._last_poll >= POLL_EVERY_S:
            self._last_poll = now
            self._pending = self._submit()
        return events

    def _submit(self) -> list[Any]:
        return [self.cluster.submit(n, scan_node_folder, str(self.log_dir), n.node_id, n.label)
                for n in self.nodes]

    def _new_oom(self, scans: list[NodeScan]) -> list[Located]:
        out = []
        for scan in scans:
            for o in scan.scan.oom:
                key = (o.file, o.line)
                if key in self._oom_seen:
                    continue
                self._oom_seen.add(key)
                out.append(Located(o.event, o.file, o.line, o.pid, o.rank, o.text))
        return out

    def collect(self) -> CollectedScan:
        if self._pending:  # an OOM poll still running: let it finish, its answer is stale
            self.cluster.gather(self._pending, self.nodes, "the OOM poll", TASK_TIMEOUT_S)
            self._pending = []
        nodes = self.cluster.gather(self._submit(), self.nodes, "the log scan", TASK_TIMEOUT_S)
        # The server's own output (vLLM's lines, the driver's echo of a rank's error) is on
        # this machine; after the ranks, so that a rank's own OOM line comes first.
        here, server_log = self.nodes[0], Path(self.follower.path)
        if server_log.exists():
            server = scan_paths([server_log])
            nodes.append(NodeScan(here.node_id, here.label, str(server_log), True, server))
        merged = merge_node_scans(nodes)
        return replace(merged, problem=self._problem(merged))

    def _problem(self, merged: CollectedScan) -> str | None:
        missing = [] if merged.scan.oom else missing_ranks(merged, self.placement.world)
        if not missing:
            return None
        where = sorted({self.placement.node_of_rank(r).label for r in missing})
        shown = ", ".join(str(r) for r in missing[:8]) + (" ..." if len(missing) > 8 else "")
        cut = [t for t in merged.scan.truncated if t.rank in missing]
        return (
            f"{len(missing)} of {self.placement.world} ranks left no complete memory-pool dump "
            f"in {self.log_dir} (ranks {shown}, expected on {', '.join(where)}"
            + (f"; {len(cut)} truncated, first: {cut[0].describe()}" if cut else "")
            + "): the worst rank "
            "may be among them; check that GLOG_v=1 and GLOG_log_dir reach every node "
            "(pretuner passes them in the launch's Ray job runtime env) and that the server "
            "stops gracefully"
        )

    def where(self) -> str:
        return f"{self.log_dir} on {len(self.nodes)} node(s) via Ray"


@dataclass(frozen=True, slots=True)
class RayCollectors:
    """The collector factory of one run (what `LaunchContext.collector` holds)."""

    cluster: RayCluster
    placement: Placement
    info: dict[str, Any]  # what the cluster check found, for the run record
    device_kind: str | None = None  # the engine's device reader, run on every node

    def __call__(self, folder: Path, log_path: Path) -> RayCollector:
        return RayCollector(self.cluster, self.placement, folder, log_path, self.device_kind)


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """What the run asks of the cluster."""

    world: int  # TP x PP ranks, one device each
    nodes_planned: int  # the layout's node count at `cards_per_node` cards a node
    emulated: bool  # the emulated card: its NPUs are `ray start --resources`, not detected
    resource: str = "NPU"  # the Ray resource one rank holds (the engine's `ray_resource`)
    # The engine's device reader, run on every node (a V1 engine: its logs do not say each
    # rank's peak); None: read on this node only
    device_kind: str | None = None
    cards_per_node: int = 8  # --cards-per-node


def check_cluster(cluster: RayCluster, plan: ClusterPlan) -> tuple[Placement, dict[str, Any]]:
    """Nodes alive with enough NPUs, the same pretuner everywhere, and every node variable
    set before `ray start` (where the ranks go, and what was found for the run record);
    otherwise ClusterError with what to do."""
    nodes = cluster.nodes()
    placement = place(nodes, plan.world, cluster.free_npus(), plan.resource)
    alive = [n for n in nodes if n.alive]
    probes = cluster.probe(placement.nodes, [n for n in alive if n not in placement.nodes])
    used = [p for p in probes if p.node in placement.nodes]
    versions = {p.node.label: p.version for p in used}
    check_versions(__version__, versions)
    # REFERENCE section 7's node variables are Ascend's (HCCL, LCCL, visible NPUs)
    problems = env_problems(used, placement) if plan.resource == "NPU" else []
    if problems:
        host, _, port = cluster.gcs_address.rpartition(":")
        extra = {n.node_id: [f'--resources={{"NPU": {n.npus}}}'] for n in alive
                 if n.npus and plan.emulated}
        commands = restart_commands(probes, proposed_envs(probes, placement), head_host=host,
                                    port=int(port), extra_args=extra)
        raise ClusterError(
            f"node variables not set before `ray start`: {describe_problems(problems)}. Ray "
            "workers inherit them from the shell that ran `ray start`, so pretuner cannot set "
            "them for a launch",
            hint="restart Ray with them on every node, then run pretuner again:\n" + commands,
        )
    return placement, {
        "ray_address": cluster.address,
        "gcs_address": cluster.gcs_address,
        "world": placement.world,
        "nodes": [
            {"node": n.label, "node_id": n.node_id, "npus": n.npus, "ranks": c,
             "local": n.local, "head": n.head}
            for n, c in zip(placement.nodes, placement.ranks_per_node, strict=True)
        ],
        "pretuner_versions": {k: v for k, v in versions.items() if v is not None},
    }


@contextmanager
def ray_cluster(address: str, plan: ClusterPlan, phase: Phase) -> Iterator[RayCollectors]:
    """Connected and checked for the whole run; disconnected at the end, whatever happens."""
    phase("cluster", f"connecting to Ray at {address}")
    cluster = RayCluster.connect(address, plan.resource)
    try:
        p, info = check_cluster(cluster, plan)
        phase("cluster", f"{plan.world} ranks on {len(p.nodes)} node(s): {p.describe()}; "
              f"pretuner {__version__} on every node; node environment set")
        if len(p.nodes) != plan.nodes_planned:
            phase("cluster", f"the layout assumed {plan.nodes_planned} node(s) of "
                  f"{plan.cards_per_node} cards; Ray places the ranks on {len(p.nodes)} "
                  f"({survey(cluster.nodes(), plan.resource)})")
        yield RayCollectors(cluster, p, info, plan.device_kind)
    finally:
        cluster.close()
