"""Each node scans its own log folder; the head merges the per-rank figures and keeps the worst.

`scan_node_folder` runs on a node (inside a Ray task pinned there) and returns the per-rank
summary as plain JSON-able data, never the log itself. `merge_node_scans` is pure: it merges
the nodes' summaries into one `ScanResult` and remembers which node each rank was on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pretuner.cluster.nodefs import node_local
from pretuner.logscan.files import Unreadable, list_log_files
from pretuner.logscan.lines import DeviceMemoryInit, Located, OomEvent, OomKind
from pretuner.logscan.result import (
    MAX_EXAMPLES,
    OomPhase,
    OomRecord,
    RankSummary,
    ScanResult,
    TruncatedRecord,
    Truncation,
)
from pretuner.logscan.scanner import ScanItem, iter_scan
from pretuner.logscan.summary import summarize_items


@dataclass(frozen=True, slots=True)
class NodeScan:
    """What one node's log folder held."""

    node_id: str
    label: str
    folder: str  # the folder as read on the node
    found: bool  # the folder exists on this node
    scan: ScanResult
    init_free_mib: tuple[int, ...]  # `Device free MOC Size` of the init lines (and the least)

    def to_wire(self) -> dict[str, Any]:
        s = self.scan
        return {
            "node_id": self.node_id,
            "label": self.label,
            "folder": self.folder,
            "found": self.found,
            "init_free_mib": list(self.init_free_mib),
            "files": list(s.files),
            "ranks": [asdict(r) for r in s.ranks],
            "oom": [_oom_wire(o) for o in s.oom],
            "truncated": [{**asdict(t), "how": t.how.value} for t in s.truncated],
            "figures": {
                "card_mib": s.card_mib,
                "kv_cache_tokens": s.kv_cache_tokens,
                "available_kv_gib": s.available_kv_gib,
                "max_concurrency": s.max_concurrency,
                "weights_gib": s.weights_gib,
                "kv_blocks": s.kv_blocks,
            },
            "unreadable": [[u.file, u.reason] for u in s.unreadable],
            "lines_scanned": s.lines_scanned,
            "bytes_scanned": s.bytes_scanned,
            "events": s.events,
            "omitted": [s.oom_omitted, s.truncated_omitted, s.prompts_ignored_omitted],
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> NodeScan:
        ranks = tuple(RankSummary(**r) for r in data["ranks"])
        oom = tuple(_oom_from_wire(o) for o in data["oom"])
        truncated = tuple(
            TruncatedRecord(**{**t, "how": Truncation(t["how"])}) for t in data.get("truncated", ())
        )
        figures = data["figures"]
        oom_omitted, truncated_omitted, ignored_omitted = data.get("omitted", (0, 0, 0))
        scan = ScanResult(
            files=tuple(data["files"]),
            ranks=ranks,
            oom=oom,
            unreadable=tuple(Unreadable(f, r) for f, r in data["unreadable"]),
            lines_scanned=data["lines_scanned"],
            bytes_scanned=data["bytes_scanned"],
            events=data["events"],
            truncated=truncated,
            oom_omitted=oom_omitted,
            truncated_omitted=truncated_omitted,
            prompts_ignored_omitted=ignored_omitted,
            **figures,
        )
        return cls(
            node_id=data["node_id"],
            label=data["label"],
            folder=data["folder"],
            found=data["found"],
            scan=scan,
            init_free_mib=tuple(data["init_free_mib"]),
        )


def _oom_wire(o: OomRecord) -> dict[str, Any]:
    event = asdict(o.event)
    event["kind"] = o.event.kind.value
    return {
        "kind": o.kind.value,
        "phase": o.phase.value,
        "file": o.file,
        "line": o.line,
        "pid": o.pid,
        "rank": o.rank,
        "text": o.text,
        "event": event,
    }


def _oom_from_wire(d: dict[str, Any]) -> OomRecord:
    event = dict(d["event"])
    event["kind"] = OomKind(event["kind"])
    return OomRecord(
        kind=OomKind(d["kind"]),
        phase=OomPhase(d["phase"]),
        file=d["file"],
        line=d["line"],
        pid=d["pid"],
        rank=d["rank"],
        text=d["text"],
        event=OomEvent(**event),
    )


def scan_node_folder(folder: str, node_id: str, label: str) -> dict[str, Any]:
    """Scan `folder` on this node's disk with pretuner's scanner (runs on the node)."""
    path = node_local(folder)
    found = path.exists()
    files, unreadable = list_log_files([path]) if found else ([], [])
    free: list[int] = []
    result = summarize_items(_noting_free(iter_scan(files), free), unreadable)
    return NodeScan(node_id, label, str(path), found, result, tuple(free)).to_wire()


def _noting_free(items: Iterable[ScanItem], free: list[int]) -> Iterator[ScanItem]:
    """The items, noting the free memory of the init lines: the first ones, then the least."""
    for item in items:
        if isinstance(item, Located) and isinstance(item.event, DeviceMemoryInit):
            mib = item.event.device_free_mib
            if mib and len(free) < MAX_EXAMPLES:
                free.append(mib)
            elif mib:
                free[-1] = min(free[-1], mib)  # what the tuner reads is the least
        yield item


@dataclass(frozen=True, slots=True)
class ClusterScan:
    """Every node's figures merged: one `ScanResult`, and where each rank was."""

    scan: ScanResult
    nodes: tuple[NodeScan, ...]
    rank_nodes: dict[str, str]  # rank name (as in rank_peaks_mib) -> node label
    rank_peaks_mib: dict[str, int]
    worst_node: str | None
    init_free_mib: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        doc = self.scan.to_json()
        doc["worst_node"] = self.worst_node
        doc["rank_nodes"] = dict(self.rank_nodes)
        doc["nodes"] = [
            {
                "node": n.label,
                "node_id": n.node_id,
                "folder": n.folder,
                "found": n.found,
                "ranks": len(n.scan.ranks),
                "worst_actual_peak_mib": n.scan.worst.actual_peak_mib if n.scan.worst else None,
                "oom": len(n.scan.oom),
            }
            for n in self.nodes
        ]
        return doc


def _rank_name(r: RankSummary) -> str:
    return f"rank{r.rank}" if r.rank is not None else f"pid{r.pid}"


def merge_node_scans(nodes: Sequence[NodeScan]) -> ClusterScan:
    """One ScanResult over all nodes; the worst rank wherever it ran.

    A folder on a shared disk is seen by every node: the same rank dump (same file, line and
    figures) counts once, for the first node that reported it. Rank numbers that repeat on
    different nodes (per-node numbering) are kept apart as `<node>/rank<N>`.
    """
    ranks: list[RankSummary] = []
    owner: list[str] = []
    seen: set[tuple[object, ...]] = set()
    for node in nodes:
        for r in node.scan.ranks:
            key = (r.rank, r.pid, r.file, r.line, r.actual_peak_mib)
            if key in seen:
                continue
            seen.add(key)
            ranks.append(r)
            owner.append(node.label)
    names = [_rank_name(r) for r in ranks]
    repeated = {n for n in names if names.count(n) > 1}
    names = [f"{node}/{n}" if n in repeated else n for n, node in zip(names, owner, strict=True)]
    oom: list[OomRecord] = []
    oom_seen: set[tuple[object, ...]] = set()
    for node in nodes:
        for o in node.scan.oom:
            where = (o.file, o.line, o.text)
            if where not in oom_seen:
                oom_seen.add(where)
                oom.append(o)
    truncated: list[TruncatedRecord] = []
    cut_seen: set[tuple[object, ...]] = set()
    for node in nodes:
        for t in node.scan.truncated:
            if (t.file, t.line, t.pid) not in cut_seen:
                cut_seen.add((t.file, t.line, t.pid))
                truncated.append(t)
    scans = [n.scan for n in nodes]
    scan = ScanResult(
        files=tuple(f"{n.label}:{f}" for n in nodes for f in n.scan.files),
        ranks=tuple(ranks),
        oom=tuple(oom),
        card_mib=_pick(max, [s.card_mib for s in scans]),
        kv_cache_tokens=_pick(min, [s.kv_cache_tokens for s in scans]),
        available_kv_gib=_pick(min, [s.available_kv_gib for s in scans]),
        max_concurrency=_pick(min, [s.max_concurrency for s in scans]),
        weights_gib=_pick(max, [s.weights_gib for s in scans]),
        kv_blocks=_pick(min, [s.kv_blocks for s in scans]),
        unreadable=tuple(
            Unreadable(f"{n.label}:{u.file}", u.reason) for n in nodes for u in n.scan.unreadable
        ),
        lines_scanned=sum(s.lines_scanned for s in scans),
        bytes_scanned=sum(s.bytes_scanned for s in scans),
        events=sum(s.events for s in scans),
        truncated=tuple(truncated),
        prompts_ignored=tuple(dict.fromkeys(p for s in scans for p in s.prompts_ignored)),
        oom_omitted=sum(s.oom_omitted for s in scans),
        truncated_omitted=sum(s.truncated_omitted for s in scans),
        prompts_ignored_omitted=sum(s.prompts_ignored_omitted for s in scans),
    )
    worst_node = owner[ranks.index(scan.worst)] if scan.worst is not None else None
    peaks = {
        name: r.actual_peak_mib
        for name, r in zip(names, ranks, strict=True)
        if r.actual_peak_mib is not None
    }
    return ClusterScan(
        scan=scan,
        nodes=tuple(nodes),
        rank_nodes=dict(zip(names, owner, strict=True)),
        rank_peaks_mib=peaks,
        worst_node=worst_node,
        init_free_mib=tuple(f for n in nodes for f in n.init_free_mib),
    )


def _pick(how: Any, values: Sequence[Any]) -> Any:
    present = [v for v in values if v is not None]
    return how(present) if present else None


def missing_ranks(merged: ClusterScan, world: int) -> list[int]:
    """Ranks 0..world-1 without a pool dump (rank folders name every rank)."""
    have = {r.rank for r in merged.scan.ranks if r.actual_peak_mib is not None}
    return [r for r in range(world) if r not in have]
