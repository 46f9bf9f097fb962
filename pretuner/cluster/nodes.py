"""The Ray cluster as pretuner sees it, and where a layout's ranks would go (pure)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from pretuner.errors import ClusterError


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """One node as Ray reports it."""

    node_id: str
    address: str  # the node's IP as Ray knows it
    alive: bool
    npus: int  # the run's device resource Ray counted (`NPU`, or `GPU`), detected or given
    local: bool = False  # pretuner, hence the server's Ray driver, runs on this node
    head: bool = False  # the node that ran `ray start --head`

    @property
    def label(self) -> str:
        # Two nodes on one machine share an IP: the node id tells them apart.
        return f"{self.address} ({self.node_id[:8]})"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a layout's ranks go: the local node first, then the others in Ray's node order."""

    nodes: tuple[NodeFacts, ...]
    ranks_per_node: tuple[int, ...]

    @property
    def world(self) -> int:
        return sum(self.ranks_per_node)

    def spans(self) -> Iterator[tuple[NodeFacts, int, int]]:
        """(node, first rank, rank count) of every node, in rank order."""
        starts = list(accumulate(self.ranks_per_node, initial=0))[:-1]
        return zip(self.nodes, starts, self.ranks_per_node, strict=True)

    def node_of_rank(self, rank: int) -> NodeFacts:
        node = next((node for node, start, n in self.spans() if rank < start + n), None)
        if node is None:
            raise IndexError(f"rank {rank} is outside a world of {self.world}")
        return node

    def describe(self) -> str:
        return ", ".join(
            f"{node.label}{' (this node)' if node.local else ''}: ranks {start}-{start + n - 1}"
            for node, start, n in self.spans()
        )


def _order(nodes: Sequence[NodeFacts]) -> list[NodeFacts]:
    """The local node first (vLLM puts rank 0 with its driver), then by address and id."""
    return sorted(nodes, key=lambda n: (not n.local, n.address, n.node_id))


def place(nodes: Sequence[NodeFacts], world: int, free_npus: int | None = None,
          unit: str = "NPU") -> Placement:
    """Fill the alive nodes with `world` ranks, one per NPU, the local node first (vLLM's Ray
    executor needs one on its driver's node); ClusterError when they do not fit."""
    # The emulated server places its ranks with this same function: the check and the
    # emulator agree.
    local = next((n for n in nodes if n.local), None)
    if local is None or not local.alive:
        raise ClusterError(
            "this machine is not a node of the Ray cluster pretuner connected to",
            hint="run pretuner on the head node (or another node that ran `ray start`)",
        )
    if local.npus < 1:
        raise ClusterError(
            f"this node {local.label} has no {unit} in Ray; the server's Ray driver runs where "
            "pretuner runs and vLLM places rank 0 there",
            hint=f"run pretuner on a node whose `ray status` shows {unit}s",
        )
    alive = [n for n in _order(nodes) if n.alive and n.npus > 0]
    total = sum(n.npus for n in alive)
    if total < world:
        raise ClusterError(
            f"{world} ranks need {world} {unit}s and the Ray cluster has {total}: "
            f"{survey(nodes, unit)}",
            hint=f"start Ray on more nodes with {unit}s (`ray start --address=HEAD_IP:PORT`), or "
            "choose a layout with fewer cards (--tp)",
        )
    if free_npus is not None and free_npus < world:
        raise ClusterError(
            f"{world} ranks need {world} free {unit}s and Ray has {free_npus} free of {total}: "
            "another job holds the rest",
            hint="stop the other job or server (`ray status` lists what holds them)",
        )
    counts: list[int] = []
    for node in alive:
        if sum(counts) == world:
            break
        counts.append(min(node.npus, world - sum(counts)))
    return Placement(tuple(alive[: len(counts)]), tuple(counts))


def survey(nodes: Sequence[NodeFacts], unit: str = "NPU") -> str:
    """Every node in one line: `192.0.2.2 (33c30b62) 8 NPU, 192.0.2.3 (6ae8ef24) dead`."""
    parts = [
        f"{n.label} {f'{n.npus} {unit}' if n.alive else 'dead'}{' (this node)' if n.local else ''}"
        for n in _order(nodes)
    ]
    return ", ".join(parts) or "no node"


def check_versions(local_version: str, versions: Mapping[str, str | None]) -> None:
    """Every node imports the same pretuner as this one (node label -> version, None: none)."""
    missing = [label for label, v in versions.items() if v is None]
    if missing:
        raise ClusterError(
            f"pretuner is not importable by Ray workers on node {', '.join(missing)}",
            hint=f"install pretuner {local_version} with the `ray` extra on every node, in the "
            "Python environment that runs `ray start`",
        )
    other = {label: v for label, v in versions.items() if v != local_version}
    if other:
        seen = ", ".join(f"{label} has {v}" for label, v in other.items())
        raise ClusterError(
            f"node {seen}; this node has pretuner {local_version}",
            hint=f"install pretuner {local_version} on every node, then restart Ray there "
            "(`ray stop`, `ray start ...`)",
        )
