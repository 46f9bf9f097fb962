"""Per-rank aggregation of located events into a `ScanResult`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pretuner.logscan.lines import (
    AvailableKvMemory,
    AvailableMemory,
    BlockCounts,
    DeviceMemoryInit,
    KvCacheSize,
    KvReserved,
    LoadingStarted,
    Located,
    MaxConcurrency,
    MemoryStat,
    MemoryStatKind,
    ModelLoaded,
    OomEvent,
    OomKind,
    PartialPoolDump,
    PoolDump,
    PoolDumpHeader,
    PoolFormat,
    PromptIgnored,
)
from pretuner.logscan.scanner import FileScan, Unreadable


class OomPhase(str, Enum):
    """When a device OOM happened, as far as the log tells."""

    WEIGHTS = "weights"  # while loading weights: raise the model budget or add cards
    ACTIVATION = "activation"  # in a kernel after loading: shorten sequences or batches
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class OomRecord:
    """One out-of-memory report, classified, with where it was found."""

    kind: OomKind
    phase: OomPhase
    file: str
    line: int
    pid: int | None
    rank: int | None
    text: str
    event: OomEvent


class Truncation(str, Enum):
    """How a memory-pool dump was cut short (its writer killed, or its log never flushed)."""

    SUMMARY_CUT = "summary_cut"  # the summary line stops before `actual peak used`
    SUMMARY_MISSING = "summary_missing"  # the per-pool header lines, then no summary line


@dataclass(frozen=True, slots=True)
class TruncatedRecord:
    """A pool dump cut short: its writer's actual peak is unknown."""

    how: Truncation
    file: str
    line: int
    pid: int | None
    rank: int | None
    peak_used_mib: float | None  # `peak used mem` printed before the cut: the peak is at least this
    text: str

    def describe(self) -> str:
        """One line for a person."""
        if self.how is Truncation.SUMMARY_CUT:
            what = "its summary line stops before `actual peak used`"
        else:
            what = "its per-pool lines are there, the summary line with `actual peak used` is not"
        floor = (
            ""
            if self.peak_used_mib is None
            else f" (at least {self.peak_used_mib:,.0f} MiB, the `peak used mem` before the cut)"
        )
        return (
            f"{writer(self.rank, self.pid)} wrote a truncated memory-pool dump at "
            f"{self.file}:{self.line}: {what}; its actual peak is unknown{floor}"
        )


def writer(rank: int | None, pid: int | None) -> str:
    """`rank 1 (pid 10559)`, `pid 10559`, `rank 1` or `an unknown process`."""
    if rank is not None:
        return f"rank {rank}" + (f" (pid {pid})" if pid is not None else "")
    return f"pid {pid}" if pid is not None else "an unknown process"


@dataclass(frozen=True, slots=True)
class RankSummary:
    """The memory figures of one rank (or one process when no rank is known)."""

    rank: int | None
    pid: int | None
    actual_peak_mib: int | None  # the largest pool dump of this rank
    file: str
    line: int  # where that largest dump is (else its cut dump, else its first event)
    peak_used_mib: float | None
    in_use_mib: float | None
    alloc_mib: float | None
    dumps: int
    card_mib: int | None
    user_define_mib: int | None
    deinit_actual_peak_mib: int | None
    oom_count: int
    truncated_dumps: int = 0  # dumps cut short: with no complete one, the peak is unknown


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What the scanner found in a set of logs."""

    files: tuple[str, ...]
    ranks: tuple[RankSummary, ...]
    worst: RankSummary | None
    oom: tuple[OomRecord, ...]
    card_mib: int | None
    kv_cache_tokens: int | None  # the smallest figure reported
    available_kv_gib: float | None  # the smallest figure reported
    max_concurrency: float | None
    weights_gib: float | None  # the largest figure reported
    kv_blocks: int | None
    unreadable: tuple[Unreadable, ...]
    lines_scanned: int
    bytes_scanned: int
    events: int
    prompts_ignored: tuple[PromptIgnored, ...] = ()  # prompts the scheduler never ran
    truncated: tuple[TruncatedRecord, ...] = ()  # pool dumps cut short, in file order

    @property
    def found_anything(self) -> bool:
        return self.events > 0

    def to_json(self) -> dict[str, Any]:
        """The `pretuner scan --json` document."""
        doc: dict[str, Any] = {
            "files": list(self.files),
            "ranks": [_rank_json(r) for r in self.ranks],
            "worst_actual_peak_mib": self.worst.actual_peak_mib if self.worst else None,
            "worst_rank": self.worst.rank if self.worst else None,
            "worst_pid": self.worst.pid if self.worst else None,
            "oom": [
                {
                    "kind": o.kind.value,
                    "phase": o.phase.value,
                    "file": o.file,
                    "line": o.line,
                    "rank": o.rank,
                    "pid": o.pid,
                    "text": o.text,
                    "alloc_bytes": o.event.alloc_bytes,
                    "estimated_max_model_len": o.event.estimated_max_model_len,
                }
                for o in self.oom
            ],
            "truncated": [truncated_json(t) for t in self.truncated],
            "unreadable": [{"file": u.file, "reason": u.reason} for u in self.unreadable],
            "lines_scanned": self.lines_scanned,
            "bytes_scanned": self.bytes_scanned,
        }
        optional = {
            "card_mib": self.card_mib,
            "kv_cache_tokens": self.kv_cache_tokens,
            "available_kv_gib": self.available_kv_gib,
            "max_concurrency": self.max_concurrency,
            "weights_gib": self.weights_gib,
            "kv_blocks": self.kv_blocks,
            "prompts_ignored": (
                [{"prompt_tokens": p.prompt_tokens, "limit": p.limit} for p in self.prompts_ignored]
                or None
            ),
        }
        doc.update({k: v for k, v in optional.items() if v is not None})
        return doc


def truncated_json(t: TruncatedRecord) -> dict[str, Any]:
    return {
        "how": t.how.value,
        "file": t.file,
        "line": t.line,
        "rank": t.rank,
        "pid": t.pid,
        "peak_used_mib": t.peak_used_mib,
        "message": t.describe(),
    }


def _rank_json(rank: RankSummary) -> dict[str, Any]:
    return {
        "rank": rank.rank,
        "pid": rank.pid,
        "actual_peak_mib": rank.actual_peak_mib,
        "peak_used_mib": rank.peak_used_mib,
        "in_use_mib": rank.in_use_mib,
        "alloc_mib": rank.alloc_mib,
        "dumps": rank.dumps,
        "card_mib": rank.card_mib,
        "user_define_mib": rank.user_define_mib,
        "deinit_actual_peak_mib": rank.deinit_actual_peak_mib,
        "oom_count": rank.oom_count,
        "truncated_dumps": rank.truncated_dumps,
        "file": rank.file,
        "line": rank.line,
    }


@dataclass
class _RankAcc:
    rank: int | None
    pid: int | None
    file: str
    line: int
    best: PoolDump | None = None
    dumps: int = 0
    card_mib: int | None = None
    user_define_mib: int | None = None
    deinit_peak_mib: int | None = None
    oom_count: int = 0
    truncated: int = 0
    pids: set[int] = field(default_factory=set)

    def cut(
        self, how: Truncation, ev: Located, pid: int | None, peak_used_mib: float | None
    ) -> TruncatedRecord:
        """Count a dump cut short; without a complete dump, it is where this rank is."""
        self.truncated += 1
        if self.best is None:
            self.file, self.line = ev.file, ev.line
        return TruncatedRecord(how, ev.file, ev.line, pid, self.rank, peak_used_mib, ev.text)


def summarize(scans: Sequence[FileScan], unreadable: Iterable[Unreadable] = ()) -> ScanResult:
    """Aggregate per rank: rank folder or vLLM tag first, otherwise one rank per process."""
    pid_rank: dict[int, int] = {}
    for scan in scans:
        for ev in scan.events:
            if ev.pid is not None and ev.rank is not None and scan.rank is None:
                pid_rank.setdefault(ev.pid, ev.rank)
    accs: dict[tuple[object, ...], _RankAcc] = {}
    oom: list[OomRecord] = []
    seen_oom: dict[tuple[object, ...], int] = {}  # one failure, echoed by several layers
    figures: dict[str, list[float]] = {}
    ignored: list[PromptIgnored] = []
    truncated: list[TruncatedRecord] = []
    for scan in scans:
        loading = False
        loaded = False
        last_pid: int | None = None
        # Dumps whose header lines were seen and whose summary line was not (yet), per writer.
        opened: dict[tuple[int | None, bool], tuple[Located, int | None, _RankAcc]] = {}
        cut: list[TruncatedRecord] = []
        for ev in scan.events:
            # A line without a writer (exception text, a traceback) belongs to the process
            # that wrote the previous memory line of the same file.
            pid = ev.pid if ev.pid is not None else last_pid
            last_pid = pid
            rank = ev.rank if ev.rank is not None else pid_rank.get(pid or -1)
            event = ev.event
            if isinstance(event, LoadingStarted):
                loading = True
                continue
            if isinstance(event, ModelLoaded):
                loaded = True
                figures.setdefault("weights", []).append(event.weights_gib)
                continue
            if isinstance(event, KvCacheSize):
                figures.setdefault("tokens", []).append(event.tokens)
                continue
            if isinstance(event, AvailableKvMemory):
                figures.setdefault("kv_gib", []).append(event.gib)
                continue
            if isinstance(event, KvReserved):
                figures.setdefault("kv_gib", []).append(event.gib)
                continue
            if isinstance(event, MaxConcurrency):
                figures.setdefault("concurrency", []).append(event.concurrency)
                continue
            if isinstance(event, AvailableMemory):
                figures.setdefault("total_bytes", []).append(event.total_bytes)
                continue
            if isinstance(event, PromptIgnored):
                ignored.append(event)
                continue
            if isinstance(event, BlockCounts):
                figures.setdefault("blocks", []).append(event.device_blocks)
                continue
            if rank is not None:
                key: tuple[object, ...] = ("rank", rank)
            elif pid is not None:
                key = ("pid", pid)
            else:
                key = ("file", scan.file)
            acc = accs.get(key)
            if acc is None:
                acc = accs[key] = _RankAcc(rank=rank, pid=pid, file=ev.file, line=ev.line)
            if pid is not None:
                acc.pids.add(pid)
            if isinstance(event, PoolDumpHeader):
                opened.setdefault((pid, event.profiled), (ev, pid, acc))
            elif isinstance(event, PartialPoolDump):
                opened.pop((pid, event.profiled), None)
                cut.append(acc.cut(Truncation.SUMMARY_CUT, ev, pid, event.peak_used_mib))
            elif isinstance(event, PoolDump):
                if event.format is not PoolFormat.ALLOC_DETAIL:
                    opened.pop((pid, event.profiled), None)
                acc.dumps += 1
                if acc.best is None or event.actual_peak_mib > acc.best.actual_peak_mib:
                    acc.best = event
                    acc.file, acc.line, acc.pid = ev.file, ev.line, pid or acc.pid
            elif isinstance(event, DeviceMemoryInit):
                acc.card_mib = event.device_mib or acc.card_mib
                acc.user_define_mib = event.user_define_mib or acc.user_define_mib
            elif isinstance(event, MemoryStat):
                if event.stat is MemoryStatKind.DEVICE:
                    acc.card_mib = acc.card_mib or event.value_mib
                elif event.stat is MemoryStatKind.ACTUAL_PEAK:
                    acc.deinit_peak_mib = max(acc.deinit_peak_mib or 0, event.value_mib)
            else:
                dedup = (
                    scan.file,
                    pid,
                    event.kind,
                    event.alloc_bytes,
                    event.estimated_max_model_len,
                    event.kv_cache_tokens,
                )
                phase = OomPhase.UNKNOWN
                if event.kind is OomKind.DEVICE_OOM:
                    if event.kernel or loaded:
                        phase = OomPhase.ACTIVATION
                    elif loading:
                        phase = OomPhase.WEIGHTS
                record = OomRecord(event.kind, phase, ev.file, ev.line, pid, rank, ev.text, event)
                if dedup in seen_oom:
                    # Keep the first report, but take the kernel name of a later echo.
                    index = seen_oom[dedup]
                    if oom[index].phase is OomPhase.UNKNOWN and phase is not OomPhase.UNKNOWN:
                        oom[index] = record
                    continue
                seen_oom[dedup] = len(oom)
                acc.oom_count += 1
                oom.append(record)
        for header, header_pid, header_acc in opened.values():
            cut.append(header_acc.cut(Truncation.SUMMARY_MISSING, header, header_pid, None))
        truncated += sorted(cut, key=lambda t: t.line)
    ranks = tuple(
        sorted(
            (_freeze(a) for a in accs.values()),
            key=lambda r: (r.rank is None, r.rank or 0, r.pid or 0, r.file),
        )
    )
    with_peak = [r for r in ranks if r.actual_peak_mib is not None]
    worst = max(with_peak, key=lambda r: r.actual_peak_mib or 0) if with_peak else None
    cards = [r.card_mib for r in ranks if r.card_mib]
    return ScanResult(
        files=tuple(s.file for s in scans),
        ranks=ranks,
        worst=worst,
        oom=tuple(oom),
        card_mib=max(cards) if cards else None,
        kv_cache_tokens=int(min(figures["tokens"])) if "tokens" in figures else None,
        available_kv_gib=min(figures["kv_gib"]) if "kv_gib" in figures else None,
        max_concurrency=min(figures["concurrency"]) if "concurrency" in figures else None,
        weights_gib=max(figures["weights"]) if "weights" in figures else None,
        kv_blocks=int(min(figures["blocks"])) if "blocks" in figures else None,
        unreadable=tuple(unreadable) + tuple(Unreadable(s.file, s.error) for s in scans if s.error),
        lines_scanned=sum(s.lines for s in scans),
        bytes_scanned=sum(s.bytes_read for s in scans),
        events=sum(len(s.events) for s in scans),
        prompts_ignored=tuple(ignored),
        truncated=tuple(truncated),
    )


def _freeze(acc: _RankAcc) -> RankSummary:
    best = acc.best
    return RankSummary(
        rank=acc.rank,
        pid=acc.pid if acc.pid is not None else (min(acc.pids) if acc.pids else None),
        actual_peak_mib=best.actual_peak_mib if best else None,
        file=acc.file,
        line=acc.line,
        peak_used_mib=best.peak_used_mib if best else None,
        in_use_mib=best.in_use_mib if best else None,
        alloc_mib=best.alloc_mib if best else None,
        dumps=acc.dumps,
        card_mib=acc.card_mib,
        user_define_mib=acc.user_define_mib,
        deinit_actual_peak_mib=acc.deinit_peak_mib,
        oom_count=acc.oom_count,
        truncated_dumps=acc.truncated,
    )


__all__ = [
    "Located",
    "OomPhase",
    "OomRecord",
    "RankSummary",
    "ScanResult",
    "TruncatedRecord",
    "Truncation",
    "summarize",
    "writer",
]
