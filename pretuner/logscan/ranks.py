"""One rank's (or process's) running figures, mergeable: how a summary stays small.

Each figure remembers the number of the event it came from, so the aggregates of one
process, built before a vLLM tag said which rank it is, fold into that rank's in any order
and give what one pass in file order would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from pretuner.logscan.pooldump import PoolDump
from pretuner.logscan.result import RankSummary

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
