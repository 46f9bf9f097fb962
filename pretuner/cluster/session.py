"""`ray_cluster(...)`: connect, check that the layout can run on the cluster, and hand the
run a collector factory that gathers every launch's logs through Ray."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pretuner import __version__
from pretuner.cluster.collector import RayCollectors
from pretuner.cluster.env import describe_problems, env_problems, proposed_envs
from pretuner.cluster.nodes import Placement, check_versions, place, survey
from pretuner.cluster.ray_api import RayCluster
from pretuner.cluster.restart import restart_commands
from pretuner.engines.base import Phase
from pretuner.errors import ClusterError


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """What the run asks of the cluster."""

    world: int  # TP x PP ranks, one NPU each
    nodes_planned: int  # the layout's node count at 8 cards per node
    emulated: bool  # the emulated card: its NPUs are `ray start --resources`, not detected


@dataclass(frozen=True, slots=True)
class ClusterCheck:
    address: str
    gcs_address: str
    placement: Placement
    versions: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        p = self.placement
        return {
            "ray_address": self.address,
            "gcs_address": self.gcs_address,
            "world": p.world,
            "nodes": [
                {
                    "node": n.label,
                    "node_id": n.node_id,
                    "npus": n.npus,
                    "ranks": c,
                    "local": n.local,
                    "head": n.head,
                }
                for n, c in zip(p.nodes, p.ranks_per_node, strict=True)
            ],
            "pretuner_versions": dict(self.versions),
        }


def check_cluster(cluster: RayCluster, plan: ClusterPlan) -> ClusterCheck:
    """Nodes alive with enough NPUs, the same pretuner everywhere, and every node variable
    set before `ray start`; otherwise ClusterError with what to do."""
    nodes = cluster.nodes()
    placement = place(nodes, plan.world, cluster.free_npus())
    alive = [n for n in nodes if n.alive]
    probes = cluster.probe(placement.nodes, [n for n in alive if n not in placement.nodes])
    used = [p for p in probes if p.node in placement.nodes]
    versions = {p.node.label: p.version for p in used}
    check_versions(__version__, versions)
    problems = env_problems(used, placement)
    if problems:
        host, _, port = cluster.gcs_address.rpartition(":")
        extra = (
            {n.node_id: [f'--resources={{"NPU": {n.npus}}}'] for n in alive if n.npus}
            if plan.emulated
            else {}
        )
        commands = restart_commands(
            probes, proposed_envs(probes, placement), head_host=host, port=int(port),
            extra_args=extra,
        )  # fmt: skip
        raise ClusterError(
            f"node variables not set before `ray start`: {describe_problems(problems)}. Ray "
            "workers inherit them from the shell that ran `ray start`, so pretuner cannot set "
            "them for a launch",
            hint="restart Ray with them on every node, then run pretuner again:\n" + commands,
        )
    return ClusterCheck(
        cluster.address,
        cluster.gcs_address,
        placement,
        {k: v for k, v in versions.items() if v is not None},
    )


@contextmanager
def ray_cluster(address: str, plan: ClusterPlan, phase: Phase) -> Iterator[RayCollectors]:
    """Connected and checked for the whole run; disconnected at the end, whatever happens."""
    phase("cluster", f"connecting to Ray at {address}")
    cluster = RayCluster.connect(address)
    try:
        check = check_cluster(cluster, plan)
        p = check.placement
        phase(
            "cluster",
            f"{plan.world} ranks on {len(p.nodes)} node(s): {p.describe()}; pretuner "
            f"{__version__} on every node; node environment set",
        )
        if len(p.nodes) != plan.nodes_planned:
            phase(
                "cluster",
                f"the layout assumed {plan.nodes_planned} node(s) of 8 cards; Ray places the "
                f"ranks on {len(p.nodes)} ({survey(cluster.nodes())})",
            )
        yield RayCollectors(cluster, p, check.to_json())
    finally:
        cluster.close()


__all__ = ["ClusterCheck", "ClusterPlan", "ray_cluster", "check_cluster"]
