"""Gather a launch's logs through Ray: every rank writes on its own node, a task pinned to
each node scans that node's folder, and the head merges the per-rank figures."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pretuner.cluster.collect import (
    ClusterScan,
    NodeScan,
    merge_node_scans,
    missing_ranks,
    scan_node_folder,
)
from pretuner.cluster.env import job_config_env
from pretuner.cluster.nodes import NodeFacts, Placement
from pretuner.cluster.ray_api import TASK_TIMEOUT_S, RayCluster
from pretuner.launch.collect import CollectedScan
from pretuner.launch.command import LaunchCommand
from pretuner.logscan import Located, LogFollower, OomEvent, scan_paths
from pretuner.logscan.lines import DeviceMemoryInit

log = logging.getLogger(__name__)

LOG_SUBDIR = "glog"  # GLOG_log_dir under the launch folder, on every node's own disk
POLL_EVERY_S = 5.0  # how often the nodes are asked for OOM lines while the server runs


class RayCollector:
    """One launch's logs on every node of the placement."""

    def __init__(
        self, cluster: RayCluster, placement: Placement, folder: Path, log_path: Path
    ) -> None:
        self.cluster = cluster
        self.placement = placement
        self.log_dir = folder.resolve() / LOG_SUBDIR
        # The server's own output, on this node: only what the live poll acts on.
        self.follower = LogFollower(log_path, keep=(OomEvent, DeviceMemoryInit))
        self._pending: list[Any] = []
        self._last_poll = 0.0
        self._oom_seen: set[tuple[str, int]] = set()

    @property
    def nodes(self) -> tuple[NodeFacts, ...]:
        return self.placement.nodes

    def prepare(self, cmd: LaunchCommand) -> LaunchCommand:
        """Ranks log to files on their own node, and every rank gets the launch's variables."""
        launch_env = {
            **cmd.env,
            "GLOG_logtostderr": "0",
            "GLOG_log_dir": str(self.log_dir),
        }
        env = {
            **launch_env,
            **job_config_env(launch_env),
            "RAY_ADDRESS": self.cluster.gcs_address,
        }
        argv = list(cmd.argv)
        if "--distributed-executor-backend" not in argv:
            argv += ["--distributed-executor-backend", "ray"]
        return LaunchCommand(argv=argv, env=env)

    def poll(self, *, final: bool = False) -> list[Located]:
        """server.log on this node, plus OOM lines found on any node (asked every few s)."""
        events = self.follower.poll(final=final)
        if final:
            return events
        now = time.monotonic()
        if self._pending and self.cluster.ready(self._pending):
            results = self.cluster.gather(self._pending, self.nodes, "the OOM poll", 1.0)
            self._pending = []
            events += self._new_oom([NodeScan.from_wire(r) for r in results])
        if not self._pending and now - self._last_poll >= POLL_EVERY_S:
            self._last_poll = now
            self._pending = self._submit()
        return events

    def _submit(self) -> list[Any]:
        return [
            self.cluster.submit(n, scan_node_folder, str(self.log_dir), n.node_id, n.label)
            for n in self.nodes
        ]

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

    def scan(self) -> ClusterScan:
        """Ask every node for its figures now and merge them."""
        refs = self._submit()
        results = self.cluster.gather(refs, self.nodes, "the log scan", TASK_TIMEOUT_S)
        return merge_node_scans([NodeScan.from_wire(r) for r in results])

    def collect(self) -> CollectedScan:
        if self._pending:  # an OOM poll still running: let it finish, its answer is stale
            self.cluster.gather(self._pending, self.nodes, "the OOM poll", TASK_TIMEOUT_S)
            self._pending = []
        nodes = self.scan().nodes
        # The server's own output (vLLM's lines, the driver's echo of a rank's error) is on
        # this machine; after the ranks, so that a rank's own OOM line comes first.
        here = self.nodes[0]
        server_log = Path(self.follower.path)
        if server_log.exists():
            server = scan_paths([server_log])
            nodes = (*nodes, NodeScan(here.node_id, here.label, str(server_log), True, server, ()))
        merged = merge_node_scans(nodes)
        return CollectedScan(
            scan=merged.scan,
            rank_peaks_mib=merged.rank_peaks_mib,
            init_free_mib=merged.init_free_mib,
            worst_node=merged.worst_node,
            problem=self._problem(merged),
            doc=merged.to_json(),
        )

    def _problem(self, merged: ClusterScan) -> str | None:
        if merged.scan.oom:
            return None
        missing = missing_ranks(merged, self.placement.world)
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


class RayCollectors:
    """The collector factory of one run (what `LaunchContext.collector` holds)."""

    def __init__(self, cluster: RayCluster, placement: Placement, info: dict[str, Any]) -> None:
        self.cluster = cluster
        self.placement = placement
        self.info = info  # what the cluster check found, for the run record

    def __call__(self, folder: Path, log_path: Path) -> RayCollector:
        return RayCollector(self.cluster, self.placement, folder, log_path)
