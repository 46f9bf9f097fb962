"""What `analyze` found in a V1 engine's log: the typed result, and its JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pretuner.analyze.v1_inputs import DevicePeak
from pretuner.engines.v1_log import V1Log
from pretuner.pinned import PinnedBudget
from pretuner.units import GIB, MIB

HELD_FROM_TOKENS = "derived: KV tokens x bytes/token"


@dataclass(frozen=True, slots=True)
class BackOff:
    """The next pinned KV after an OOM: the KV the run had less the failed allocation and the
    margin, rounded down to a MiB (`pretuner.pinned.back_off_bytes`)."""

    from_kv_bytes: int
    alloc_bytes: int | None
    margin_mib: int
    margin_basis: str
    kv_bytes: int

    def lines(self) -> list[str]:
        alloc = "no size in the OOM" if self.alloc_bytes is None else "failed allocation"
        alloc_mib = (self.alloc_bytes or 0) / MIB
        return [
            f"back-off = KV in the log {self.from_kv_bytes / MIB:,.1f} MiB (measured) - {alloc} "
            f"{alloc_mib:,.1f} MiB (measured) - margin {self.margin_mib:,} MiB "
            f"({self.margin_basis}) = {self.kv_bytes // MIB:,} MiB "
            f"({self.kv_bytes / GIB:.2f} GiB, derived), rounded down to a MiB",
        ]


@dataclass(frozen=True, slots=True)
class Suggestion:
    """The `--kv-cache-memory-bytes` to try, and what it holds next to the log's run."""

    kv_bytes: int
    basis: str  # "measured peak", "log: ready run", "back-off"
    kv_tokens: int | None  # at the bytes/token below; None when it is not known
    kv_tokens_exact: bool  # False when the bytes/token was derived from a rounded GiB figure
    held_kv_bytes: int | None  # the log's KV, for the gain
    held_kv_tokens: int | None
    max_model_len: int | None

    @property
    def flag(self) -> str:
        return f"--kv-cache-memory-bytes {self.kv_bytes}"

    @property
    def gain_bytes(self) -> int | None:
        return None if self.held_kv_bytes is None else self.kv_bytes - self.held_kv_bytes

    @property
    def gain_tokens(self) -> int | None:
        if self.kv_tokens is None or self.held_kv_tokens is None:
            return None
        return self.kv_tokens - self.held_kv_tokens

    @property
    def max_concurrency(self) -> float | None:
        if self.kv_tokens is None or not self.max_model_len:
            return None
        return self.kv_tokens / self.max_model_len

    @property
    def from_log(self) -> bool:
        """Whether this only repeats the KV the log's run held (no device peak to go further)."""
        return self.basis.startswith("log:")

    def lines(self) -> list[str]:
        about = "" if self.kv_tokens_exact else "about "
        out = []
        if self.kv_tokens is not None:
            conc = self.max_concurrency
            at = f"; {conc:.2f}x at max_model_len {self.max_model_len:,}" if conc else ""
            out.append(f"KV tokens at {self.kv_bytes // MIB:,} MiB: {about}{self.kv_tokens:,} "
                       f"(derived){at}")
        gain = self.gain_bytes
        if self.from_log:
            out.append("the KV cache of the log's run, pinned: no gain until the device peak "
                       "is measured")
        elif gain is not None and self.held_kv_bytes is not None:
            line = (f"gain vs the log: {self.kv_bytes / MIB:,.1f} MiB - "
                    f"{self.held_kv_bytes / MIB:,.1f} MiB = {gain / MIB:+,.1f} MiB "
                    f"({gain / GIB:+.2f} GiB)")
            if self.gain_tokens is not None and self.held_kv_tokens is not None:
                line += (f", {self.kv_tokens:,} - {self.held_kv_tokens:,} tokens = "
                         f"{about}{self.gain_tokens:+,} tokens")
            out.append(line)
        return out

    def to_json(self) -> dict[str, Any]:
        conc = self.max_concurrency
        return {
            "kv_bytes": self.kv_bytes,
            "kv_mib": self.kv_bytes // MIB,
            "kv_gib": round(self.kv_bytes / GIB, 2),
            "flag": self.flag,
            "basis": self.basis,
            "kv_tokens": self.kv_tokens,
            "kv_tokens_exact": self.kv_tokens_exact,
            "max_concurrency": None if conc is None else round(conc, 2),
            "held_kv_bytes": self.held_kv_bytes,
            "held_kv_tokens": self.held_kv_tokens,
            "gain_bytes": self.gain_bytes,
            "gain_tokens": self.gain_tokens,
        }


@dataclass(frozen=True, slots=True)
class V1Analysis:
    """What a V1 log shows, with where each figure comes from, and the KV budget to try."""

    files: tuple[str, ...]
    outcome: str  # one line: ready / failed at start-up / died serving ...
    oom_phase: str | None  # "start-up", "prefill", "serving"
    log: V1Log
    kv_mode: str | None  # "pinned" (--kv-cache-memory-bytes) or "profiled" (util)
    kv_in_log_bytes: int | None  # the KV the run asked for: pinned exactly, else profiled
    max_model_len: int | None
    tp: int
    pp: int
    bytes_per_token: int | None
    bytes_per_token_source: str | None
    held_kv_bytes: int | None  # the KV cache the run held
    held_kv_source: str | None
    series: DevicePeak | None
    total_mib: int | None
    total_source: str | None
    budget: PinnedBudget | None  # with a measured peak and a total
    back_off: BackOff | None  # after an OOM
    suggestion: Suggestion | None
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    next_step: str
    provenance: dict[str, str]

    @property
    def held_kv_from_tokens(self) -> bool:
        return self.held_kv_source == HELD_FROM_TOKENS

    def to_json(self) -> dict[str, Any]:
        log = self.log
        budget = self.budget
        return {
            "engine": "v1",
            "files": list(self.files),
            "outcome": self.outcome,
            "ready": log.ready,
            "start_failed": log.start_failed,
            "engine_dead": log.engine_dead,
            "weights_gib": log.weights_gib,
            "kv_mode": self.kv_mode,
            "kv_gib": log.kv_gib,
            "kv_in_log_bytes": self.kv_in_log_bytes,
            "kv_tokens": log.kv_tokens,
            "max_model_len": self.max_model_len,
            "max_concurrency": log.max_concurrency,
            "graphs_gib": log.graphs_gib,
            "non_kv_gib_log": log.non_kv_gib,
            "max_num_batched_tokens": log.max_num_batched_tokens,
            "oom": None if self.oom_phase is None else {
                "alloc_bytes": log.oom_alloc_bytes,
                "text": log.oom_text,
                "phase": self.oom_phase,
            },
            "estimated_max_len": log.estimated_max_len,
            "no_kv_memory": log.no_kv_memory,
            "refused_free_gib": log.refused_free_gib,
            "tp": self.tp,
            "pp": self.pp,
            "kv_bytes_per_token": self.bytes_per_token,
            "held_kv_bytes": self.held_kv_bytes,
            "device": None if self.series is None else self.series.to_json(),
            "total_mib": self.total_mib,
            "budget": None if budget is None else {
                "peak_mib": budget.peak_mib,
                "held_kv_bytes": self.held_kv_bytes,
                "held_kv_mib": round(budget.held_kv_mib, 1),
                "non_kv_mib": round(budget.non_kv_mib, 1),
                "total_mib": budget.total_mib,
                "margin_mib": budget.margin_mib,
                "kv_mib": budget.kv_mib,
                "kv_bytes": budget.kv_bytes,
                "source": budget.source,
            },
            "back_off": None if self.back_off is None else {
                "from_kv_bytes": self.back_off.from_kv_bytes,
                "alloc_bytes": self.back_off.alloc_bytes,
                "margin_mib": self.back_off.margin_mib,
                "margin_basis": self.back_off.margin_basis,
                "kv_bytes": self.back_off.kv_bytes,
            },
            "suggestion": None if self.suggestion is None else self.suggestion.to_json(),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "next_step": self.next_step,
            "provenance": self.provenance,
        }
