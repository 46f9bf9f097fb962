"""Per-rank aggregation of located events into a `ScanResult`, streamed, in bounded memory.

`Summariser` takes the events one at a time, in file order, and keeps one aggregate per rank
or process, the smallest and largest vLLM figures, and the first MAX_EXAMPLES OOM,
truncated-dump and ignored-prompt records (the rest are counted). Which rank a process is
(a vLLM worker tag names both) may be printed after that process's first memory lines, so the
per-process aggregates are folded into their rank at the end: every aggregate remembers the
order of what it saw, so the fold gives what a second pass over the events would.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pretuner.logscan.events import (
    AvailableKvMemory,
    BlockCounts,
    DeviceMemoryInit,
    KvReserved,
    LoadingStarted,
    Located,
    LogEvent,
    MaxConcurrency,
    MemoryStat,
    MemoryStatKind,
    ModelLoaded,
    OomEvent,
    OomKind,
    PromptIgnored,
)
from pretuner.logscan.files import Unreadable
from pretuner.logscan.pooldump import PartialPoolDump, PoolDump, PoolDumpHeader, PoolFormat
from pretuner.logscan.result import (
    ENGINE_FIGURES,
    MAX_EXAMPLES,
    OomPhase,
    OomRecord,
    RankSummary,
    ScanResult,
    TruncatedRecord,
    Truncation,
)
from pretuner.logscan.scanner import FileDone, FileStart, ScanItem
from pretuner.logscan.v1 import V1Log

# The events that carry one of the scan's engine figures (`result.ENGINE_FIGURES`), and its value.
_FIGURES: dict[type, Callable[[Any], tuple[str, Any]]] = {
    ModelLoaded: lambda e: ("weights_gib", e.weights_gib),
    AvailableKvMemory: lambda e: ("available_kv_gib", e.gib),
    KvReserved: lambda e: ("available_kv_gib", e.gib),
    MaxConcurrency: lambda e: ("max_concurrency", e.concurrency),
    BlockCounts: lambda e: ("kv_blocks", e.device_blocks),
}
_DECIDES = dict(ENGINE_FIGURES)

MAX_OOM_KEYS = 4096  # OOM reports remembered per file to drop their echoes (most recent kept)


Where = tuple[int, str, int, int | None]  # event number, file, line, pid
_T = TypeVar("_T", tuple[int, int], Where)


@dataclass(slots=True)
class RankAcc:
    """One rank's (or process's) figures; each remembers when it was seen, so two merge."""

    rank: int | None
    first: Where
    best: PoolDump | None = None
    best_at: Where | None = None
    cut_at: Where | None = None  # the last dump cut short
    dumps: int = 0
    card_init: tuple[int, int] | None = None  # (event number, MiB) of the last init line
    card_stat: tuple[int, int] | None = None  # the first deinit `Device memory size`
    user_define: tuple[int, int] | None = None  # of the last init line that has one
    deinit_peak_mib: int | None = None
    oom_count: int = 0
    truncated: int = 0
    pids: set[int] = field(default_factory=set)

    def merge(self, other: RankAcc) -> None:
        """Fold in the aggregate of other events of the same rank."""
        self.first = min(self.first, other.first)
        if (
            other.best is not None
            and other.best_at is not None
            and _better(other.best, other.best_at, self)
        ):
            self.best, self.best_at = other.best, other.best_at
        self.cut_at = _latest(self.cut_at, other.cut_at)
        self.dumps += other.dumps
        self.card_init = _latest(self.card_init, other.card_init)
        stats = [s for s in (self.card_stat, other.card_stat) if s is not None]
        self.card_stat = min(stats, key=lambda s: (not s[1], s[0])) if stats else None
        self.user_define = _latest(self.user_define, other.user_define)
        peaks = [p for p in (self.deinit_peak_mib, other.deinit_peak_mib) if p is not None]
        self.deinit_peak_mib = max(peaks) if peaks else None
        self.oom_count += other.oom_count
        self.truncated += other.truncated
        self.pids |= other.pids

    def freeze(self) -> RankSummary:
        best = self.best
        where = self.best_at or self.cut_at or self.first
        pid = next((p for p in (self.best_at and self.best_at[3], self.first[3]) if p), None)
        card = self.card_init or self.card_stat
        return RankSummary(
            rank=self.rank,
            pid=pid if pid is not None else (min(self.pids) if self.pids else None),
            actual_peak_mib=best.actual_peak_mib if best else None,
            file=where[1],
            line=where[2],
            peak_used_mib=best.peak_used_mib if best else None,
            in_use_mib=best.in_use_mib if best else None,
            alloc_mib=best.alloc_mib if best else None,
            dumps=self.dumps,
            card_mib=card[1] if card else None,
            user_define_mib=self.user_define[1] if self.user_define else None,
            deinit_actual_peak_mib=self.deinit_peak_mib,
            oom_count=self.oom_count,
            truncated_dumps=self.truncated,
        )


def _better(best: PoolDump, at: Where, acc: RankAcc) -> bool:
    """Whether a dump beats acc's best: a larger peak, or as large and seen first."""
    if acc.best is None or acc.best_at is None:
        return True
    return (-best.actual_peak_mib, at[0]) < (-acc.best.actual_peak_mib, acc.best_at[0])


def _latest(a: _T | None, b: _T | None) -> _T | None:
    """The one seen later (the larger event number)."""
    if a is None or b is None:
        return a if b is None else b
    return a if a[0] >= b[0] else b


@dataclass
class _FileState:
    """What a summary remembers within one file."""

    file: str
    rank: int | None
    loading: bool = False
    loaded: bool = False
    last_pid: int | None = None
    # Dumps whose header lines were seen and whose summary line was not (yet), per writer.
    opened: dict[tuple[int | None, bool], tuple[Located, int | None, RankAcc]] = field(
        default_factory=dict
    )
    cut: list[TruncatedRecord] = field(default_factory=list)  # the first MAX_EXAMPLES
    cut_omitted: int = 0
    oom_seen: OrderedDict[tuple[object, ...], int] = field(default_factory=OrderedDict)


class Summariser:
    """Aggregate per rank: rank folder or vLLM tag first, otherwise one rank per process."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.errors: list[Unreadable] = []
        self.lines = 0
        self.bytes_read = 0
        self.events = 0
        self._seq = 0  # numbers events and end-of-file cuts in the order they were seen
        self.pid_rank: dict[int, int] = {}
        self.accs: dict[tuple[object, ...], RankAcc] = {}
        self.oom: list[OomRecord] = []
        self.oom_omitted = 0
        self.ignored: list[PromptIgnored] = []
        self.ignored_omitted = 0
        self.truncated: list[TruncatedRecord] = []
        self.truncated_omitted = 0
        self.figures: dict[str, Any] = {}  # of _FIGURES, the one that decides (ENGINE_FIGURES)
        self.init_free: list[int] = []
        self.v1 = V1Log()
        self._file: _FileState | None = None

    def feed(self, items: Iterable[ScanItem]) -> Summariser:
        for item in items:
            if isinstance(item, Located):
                self.add(item)
            elif isinstance(item, FileStart):
                self._file = _FileState(item.file, item.rank)
            else:
                self.end_file(item)
        return self

    def add(self, ev: Located) -> None:
        state = self._file
        if state is None or state.file != ev.file:
            state = self._file = _FileState(ev.file, None)
        self.events += 1
        self._seq += 1
        # A line without a writer (exception text, a traceback) belongs to the process
        # that wrote the previous memory line of the same file.
        pid = ev.pid if ev.pid is not None else state.last_pid
        state.last_pid = pid
        if ev.pid is not None and ev.rank is not None and state.rank is None:
            self.pid_rank.setdefault(ev.pid, ev.rank)
        event = ev.event
        self.v1 = self.v1.add(event)
        if (figure := _FIGURES.get(type(event))) is not None:
            name, value = figure(event)
            held = self.figures.get(name)
            self.figures[name] = value if held is None else _DECIDES[name](held, value)
        if isinstance(event, LoadingStarted):
            state.loading = True
        elif isinstance(event, ModelLoaded):
            state.loaded = True
        elif isinstance(event, PromptIgnored):
            if len(self.ignored) < MAX_EXAMPLES:
                self.ignored.append(event)
            else:
                self.ignored_omitted += 1
        elif isinstance(event, PoolDumpHeader | PartialPoolDump | PoolDump | DeviceMemoryInit
                        | MemoryStat | OomEvent):
            self._per_rank(state, ev, event, pid)
        # the rest (AvailableMemory, a V1 engine's start-up) is only the V1 fold's

    def _acc(self, ev: Located, pid: int | None) -> RankAcc:
        if ev.rank is not None:
            key: tuple[object, ...] = ("rank", ev.rank)
        elif pid is not None:
            key = ("pid", pid)  # folded into its rank at the end if a tag names it
        else:
            key = ("file", ev.file)
        acc = self.accs.get(key)
        if acc is None:
            acc = self.accs[key] = RankAcc(ev.rank, (self._seq, ev.file, ev.line, pid))
        if pid is not None:
            acc.pids.add(pid)
        return acc

    def _per_rank(self, state: _FileState, ev: Located, event: LogEvent, pid: int | None) -> None:
        acc = self._acc(ev, pid)
        now = self._seq
        if isinstance(event, PoolDumpHeader):
            state.opened.setdefault((pid, event.profiled), (ev, pid, acc))
        elif isinstance(event, PartialPoolDump):
            state.opened.pop((pid, event.profiled), None)
            self._cut(state, acc, Truncation.SUMMARY_CUT, ev, pid, event.peak_used_mib)
        elif isinstance(event, PoolDump):
            if event.format is not PoolFormat.ALLOC_DETAIL:
                state.opened.pop((pid, event.profiled), None)
            acc.dumps += 1
            if acc.best is None or event.actual_peak_mib > acc.best.actual_peak_mib:
                acc.best, acc.best_at = event, (now, ev.file, ev.line, pid)
        elif isinstance(event, DeviceMemoryInit):
            free = event.device_free_mib
            if free and len(self.init_free) < MAX_EXAMPLES:
                self.init_free.append(free)
            elif free:
                self.init_free[-1] = min(self.init_free[-1], free)  # the tuner reads the least
            if event.device_mib:
                acc.card_init = (now, event.device_mib)
            if event.user_define_mib:
                acc.user_define = (now, event.user_define_mib)
        elif isinstance(event, MemoryStat):
            if event.stat is MemoryStatKind.DEVICE:
                if acc.card_stat is None or (not acc.card_stat[1] and event.value_mib):
                    acc.card_stat = (now, event.value_mib)
            elif event.stat is MemoryStatKind.ACTUAL_PEAK:
                acc.deinit_peak_mib = max(acc.deinit_peak_mib or 0, event.value_mib)
        elif isinstance(event, OomEvent):
            self._oom(state, acc, ev, event, pid)

    def _cut(self, state: _FileState, acc: RankAcc, how: Truncation, ev: Located,
             pid: int | None, peak_used_mib: float | None) -> None:
        """Count a dump cut short; without a complete dump, it is where its rank is."""
        acc.truncated += 1
        acc.cut_at = (self._seq, ev.file, ev.line, pid)
        if len(state.cut) < MAX_EXAMPLES:
            state.cut.append(TruncatedRecord(how, ev.file, ev.line, pid, acc.rank, peak_used_mib,
                                             ev.text))
        else:
            state.cut_omitted += 1

    def _oom(self, state: _FileState, acc: RankAcc, ev: Located, event: OomEvent,
             pid: int | None) -> None:
        dedup = (pid, event.kind, event.alloc_bytes, event.estimated_max_model_len,
                 event.kv_cache_tokens)
        phase = OomPhase.UNKNOWN
        if event.kind is OomKind.DEVICE_OOM:
            if event.kernel or state.loaded:
                phase = OomPhase.ACTIVATION
            elif state.loading:
                phase = OomPhase.WEIGHTS
        record = OomRecord(event.kind, phase, ev.file, ev.line, pid, acc.rank, ev.text, event)
        index = state.oom_seen.get(dedup)
        if index is not None:  # one failure, echoed by several layers
            state.oom_seen.move_to_end(dedup)
            # Keep the first report, but take the kernel name of a later echo.
            known = phase is not OomPhase.UNKNOWN
            if index >= 0 and known and self.oom[index].phase is OomPhase.UNKNOWN:
                self.oom[index] = record
            return
        acc.oom_count += 1
        if len(self.oom) < MAX_EXAMPLES:
            state.oom_seen[dedup] = len(self.oom)
            self.oom.append(record)
        else:
            state.oom_seen[dedup] = -1
            self.oom_omitted += 1
        if len(state.oom_seen) > MAX_OOM_KEYS:
            state.oom_seen.popitem(last=False)

    def end_file(self, done: FileDone) -> None:
        state = self._file if self._file and self._file.file == done.file else None
        self._file = None
        self.files.append(done.file)
        self.lines += done.lines
        self.bytes_read += done.bytes_read
        if done.error:
            self.errors.append(Unreadable(done.file, done.error))
        if state is None:
            return
        for header, header_pid, header_acc in state.opened.values():
            self._seq += 1  # a header's dump never ended: cut where the header is
            self._cut(state, header_acc, Truncation.SUMMARY_MISSING, header, header_pid, None)
        cut = sorted(state.cut, key=lambda t: t.line)
        room = max(0, MAX_EXAMPLES - len(self.truncated))
        self.truncated += cut[:room]
        self.truncated_omitted += len(cut) - len(cut[:room]) + state.cut_omitted

    def result(self, unreadable: Iterable[Unreadable] = ()) -> ScanResult:
        """The summary of everything fed so far."""
        accs: dict[tuple[object, ...], RankAcc] = {}
        for key, acc in self.accs.items():
            rank = self._rank(acc.rank, key[1] if key[0] == "pid" else None)  # type: ignore[arg-type]
            final = ("rank", rank) if rank is not None else key
            if final in accs:
                accs[final].merge(acc)
            else:
                accs[final] = dataclasses.replace(acc, rank=rank, pids=set(acc.pids))
        ranks = tuple(sorted((a.freeze() for a in accs.values()),
                             key=lambda r: (r.rank is None, r.rank or 0, r.pid or 0, r.file)))
        figures = {name: self.figures.get(name) for name in _DECIDES}
        figures["card_mib"] = max((r.card_mib for r in ranks if r.card_mib), default=None)
        figures["kv_cache_tokens"] = self.v1.kv_tokens  # the smallest, as the V1 fold keeps it
        return ScanResult(
            files=tuple(self.files),
            ranks=ranks,
            oom=tuple(dataclasses.replace(o, rank=self._rank(o.rank, o.pid)) for o in self.oom),
            **figures,
            unreadable=tuple(unreadable) + tuple(self.errors),
            lines_scanned=self.lines,
            bytes_scanned=self.bytes_read,
            events=self.events,
            prompts_ignored=tuple(self.ignored),
            truncated=tuple(dataclasses.replace(t, rank=self._rank(t.rank, t.pid))
                            for t in self.truncated),
            oom_omitted=self.oom_omitted,
            truncated_omitted=self.truncated_omitted,
            prompts_ignored_omitted=self.ignored_omitted,
            init_free_mib=tuple(self.init_free),
            v1=self.v1,
        )

    def _rank(self, rank: int | None, pid: int | None) -> int | None:
        """A known rank, else the rank a vLLM tag gave the writing process anywhere."""
        return rank if rank is not None else self.pid_rank.get(pid or -1)


def summarize_items(items: Iterable[ScanItem], unreadable: Iterable[Unreadable] = ()) -> ScanResult:
    """Summarise a stream of scan items (`scanner.iter_scan`)."""
    return Summariser().feed(items).result(unreadable)
