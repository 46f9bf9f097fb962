"""What a scan found: per-rank summaries, OOM and truncated-dump records, and the JSON of it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from pretuner.logscan.events import OomEvent, OomKind, PromptIgnored
from pretuner.logscan.files import Unreadable
from pretuner.logscan.v1 import V1Log

MAX_EXAMPLES = 100  # OOM, truncated-dump and ignored-prompt records kept; the rest are counted
# A scan's figures of the card and the engine, and which of several reports decides: the
# largest card and weights, the least KV (the rank or node that runs out first).
ENGINE_FIGURES = (("card_mib", max), ("kv_cache_tokens", min), ("available_kv_gib", min),
                  ("max_concurrency", min), ("weights_gib", max), ("kv_blocks", min))


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
    peak_used_mib: float | None
    in_use_mib: float | None
    alloc_mib: float | None
    dumps: int
    card_mib: int | None
    user_define_mib: int | None
    deinit_actual_peak_mib: int | None
    oom_count: int
    truncated_dumps: int  # dumps cut short: with no complete one, the peak is unknown
    file: str
    line: int  # where that largest dump is (else its cut dump, else its first event)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What the scanner found in a set of logs."""

    files: tuple[str, ...]
    ranks: tuple[RankSummary, ...]
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
    # Records beyond the first MAX_EXAMPLES of each list: counted, not kept (bounded memory).
    oom_omitted: int = 0
    truncated_omitted: int = 0
    prompts_ignored_omitted: int = 0
    init_free_mib: tuple[int, ...] = ()  # `Device free MOC Size` of the init lines, then the least
    v1: V1Log = V1Log()  # a V1 engine's facts (not in the JSON: `analyze` reads them)

    @property
    def worst(self) -> RankSummary | None:
        """The rank with the largest complete pool dump (the first of equals)."""
        with_peak = [r for r in self.ranks if r.actual_peak_mib is not None]
        return max(with_peak, key=lambda r: r.actual_peak_mib or 0) if with_peak else None

    @property
    def oom_total(self) -> int:
        return len(self.oom) + self.oom_omitted

    @property
    def truncated_total(self) -> int:
        return len(self.truncated) + self.truncated_omitted

    @property
    def prompts_ignored_total(self) -> int:
        return len(self.prompts_ignored) + self.prompts_ignored_omitted

    def to_json(self) -> dict[str, Any]:
        """The `pretuner scan --json` document."""
        doc: dict[str, Any] = {
            "files": list(self.files),
            "ranks": [asdict(r) for r in self.ranks],
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
            **{name: getattr(self, name) for name, _ in ENGINE_FIGURES},
            "prompts_ignored": (
                [{"prompt_tokens": p.prompt_tokens, "limit": p.limit} for p in self.prompts_ignored]
                or None
            ),
            # Only past MAX_EXAMPLES records: a normal log's document is unchanged.
            "oom_omitted": self.oom_omitted or None,
            "truncated_omitted": self.truncated_omitted or None,
            "prompts_ignored_omitted": self.prompts_ignored_omitted or None,
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
