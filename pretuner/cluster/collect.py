"""Each node scans its own log folder; the head merges the per-rank figures and keeps the worst.

`scan_node_folder` runs on a node (inside a Ray task pinned there) and returns the per-rank
summary (Ray pickles it), never the log itself. `merge_node_scans` is pure: it merges the
nodes' summaries into one scan and remembers which node each rank was on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pretuner.cluster.nodefs import node_local
from pretuner.launch.collect import CollectedScan, rank_name
from pretuner.logscan import scan_paths
from pretuner.logscan.files import Unreadable
from pretuner.logscan.result import ENGINE_FIGURES, ScanResult
from pretuner.logscan.summary import summarize_items

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NodeScan:
    """What one node's log folder held."""

    node_id: str
    label: str
    folder: str  # the folder as read on the node
    found: bool  # the folder exists on this node
    scan: ScanResult


def scan_node_folder(folder: str, node_id: str, label: str) -> NodeScan:
    """Scan `folder` on this node's disk with pretuner's scanner (runs on the node)."""
    path = node_local(folder)
    found = path.exists()
    scan = scan_paths([path]) if found else summarize_items(())
    return NodeScan(node_id, label, str(path), found, scan)


def merge_node_scans(nodes: Sequence[NodeScan]) -> CollectedScan:
    """One scan over all nodes; the worst rank wherever it ran."""
    # A folder on a shared disk is seen by every node: the same rank dump (same file, line and
    # figures) counts once, for the first node that reported it. Rank numbers that repeat on
    # different nodes (per-node numbering) are kept apart as `<node>/rank<N>`.
    placed = _first(
        ((r, n.label) for n in nodes for r in n.scan.ranks),
        lambda p: (p[0].rank, p[0].pid, p[0].file, p[0].line, p[0].actual_peak_mib),
    )
    ranks = [r for r, _ in placed]
    owner = [label for _, label in placed]
    names = [rank_name(r) for r in ranks]
    repeated = {n for n in names if names.count(n) > 1}
    names = [f"{node}/{n}" if n in repeated else n for n, node in zip(names, owner, strict=True)]
    oom = _first((o for n in nodes for o in n.scan.oom), lambda o: (o.file, o.line, o.text))
    truncated = _first((t for n in nodes for t in n.scan.truncated),
                       lambda t: (t.file, t.line, t.pid))
    scans = [n.scan for n in nodes]
    picked = {name: _pick(how, [getattr(s, name) for s in scans]) for name, how in ENGINE_FIGURES}
    scan = ScanResult(
        files=tuple(f"{n.label}:{f}" for n in nodes for f in n.scan.files),
        ranks=tuple(ranks),
        oom=tuple(oom),
        unreadable=tuple(
            Unreadable(f"{n.label}:{u.file}", u.reason) for n in nodes for u in n.scan.unreadable
        ),
        truncated=tuple(truncated),
        prompts_ignored=tuple(dict.fromkeys(p for s in scans for p in s.prompts_ignored)),
        **picked,
        **{name: sum(getattr(s, name) for s in scans) for name in _SUMS},
    )
    worst_node = owner[ranks.index(scan.worst)] if scan.worst is not None else None
    doc = scan.to_json()
    doc["worst_node"] = worst_node
    doc["rank_nodes"] = dict(zip(names, owner, strict=True))  # rank name -> node label
    doc["nodes"] = [
        {"node": n.label, "node_id": n.node_id, "folder": n.folder, "found": n.found,
         "ranks": len(n.scan.ranks),
         "worst_actual_peak_mib": n.scan.worst.actual_peak_mib if n.scan.worst else None,
         "oom": len(n.scan.oom)}
        for n in nodes
    ]
    return CollectedScan(
        scan,
        {name: r.actual_peak_mib for name, r in zip(names, ranks, strict=True)
         if r.actual_peak_mib is not None},
        init_free_mib=tuple(f for n in nodes for f in n.scan.init_free_mib),
        worst_node=worst_node,
        doc=doc,
    )


def _first(items: Iterable[T], key: Callable[[T], object]) -> list[T]:
    """Each item whose key was not seen before, in order."""
    seen: dict[object, T] = {}
    for item in items:
        seen.setdefault(key(item), item)
    return list(seen.values())


_SUMS = ("lines_scanned", "bytes_scanned", "events", "oom_omitted", "truncated_omitted",
         "prompts_ignored_omitted")


def _pick(how: Any, values: Sequence[Any]) -> Any:
    present = [v for v in values if v is not None]
    return how(present) if present else None


def missing_ranks(merged: CollectedScan, world: int) -> list[int]:
    """Ranks 0..world-1 without a pool dump (rank folders name every rank)."""
    have = {r.rank for r in merged.scan.ranks if r.actual_peak_mib is not None}
    return [r for r in range(world) if r not in have]
