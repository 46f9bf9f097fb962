"""`analyze` on a V1 engine's log (vLLM >= 0.8 on CUDA and CPU, vllm-ascend, vLLM-MindSpore >=
0.3): what the run shows, and the `--kv-cache-memory-bytes` to try next.

With a device memory series of the run and the device total, the measured non-KV peak says
what the card could hold (`pretuner.pinned.derive_pinned`). Without one, only what the log
proves: a run that was ready holds its KV cache (pinning it keeps it), and a run that ran out
of memory needs less KV by the allocation that failed plus the margin (`back_off_bytes`).
Either way the figure is a candidate until a run under the worst-case request proves it.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pretuner.analyze import AnalyzeConfig, pick
from pretuner.devices.nvidia import parse_nvidia_smi_csv, parse_nvml_series, series_peaks
from pretuner.devices.series import parse_memory_tsv
from pretuner.errors import BadInputError, NothingFoundError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens
from pretuner.logscan.v1 import V1Log
from pretuner.pinned import (
    MARGIN_FLOOR_MIB,
    PinnedBudget,
    back_off_bytes,
    derive_pinned,
    kv_held_bytes,
    margin_mib,
)
from pretuner.units import GIB, MIB

# A KV figure from the log and tokens x bytes/token from --model further apart than this
# means the model, TP or KV dtype given is not the one that ran (the log prints 1-2 decimals).
MISMATCH_SHARE = 0.02
HELD_FROM_TOKENS = "derived: KV tokens x bytes/token"
_LOG_FIGURES = ("weights_gib", "kv_gib", "kv_tokens", "max_concurrency", "graphs_gib",
                "oom_alloc_bytes", "max_model_len", "max_num_batched_tokens")
SERIES_HINT = "pass the NVML series (TSV) or nvidia-smi CSV sampled during the run"


@dataclass(frozen=True, slots=True)
class DevicePeak:
    """The worst device's highest sample in a memory series file, MiB."""

    file: str
    source: str  # "nvml" (the NVML series), "nvidia-smi" (its CSV), or the reader that wrote
    # pretuner's own launch-N/memory.tsv
    samples: int
    peak_mib: int
    total_mib: int | None  # the nvidia-smi CSV and memory.tsv say it; the NVML series does not
    phase_peaks_mib: dict[str, int] = field(default_factory=dict)
    runs: tuple[str, ...] = ()  # the run labels of an NVML series (`run:phase`)


def read_memory_series(text: str, file: str) -> DevicePeak:
    """The device peak of a launch's memory.tsv, an NVML series or nvidia-smi CSV rows."""
    launch = parse_memory_tsv(0, text)
    if launch.rows:
        phases: dict[str, int] = {}
        for row in launch.rows:
            phases[row.phase] = max(phases.get(row.phase, 0), row.used_mib)
        return DevicePeak(file, launch.reader or "memory.tsv", len({r.t_s for r in launch.rows}),
                          max(phases.values()), launch.total_mib, phases)
    points = parse_nvml_series(text)
    if points:
        runs = tuple(dict.fromkeys(p.run for p in points if p.run is not None))
        return DevicePeak(file, "nvml", len(points), max(p.used_mib for p in points), None,
                          series_peaks(points), runs)
    rows = parse_nvidia_smi_csv(text)
    if rows:
        worst = max(rows, key=lambda r: r.used_mib)
        return DevicePeak(file, "nvidia-smi", len(rows), worst.used_mib, worst.total_mib)
    raise BadInputError(
        f"--memory-series {file!r} holds no memory samples",
        hint="give a pretuner launch's memory.tsv, NVML series rows "
        "`EPOCH_S<TAB>PHASE<TAB>USED_MIB` or the output of "
        "`nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits` "
        "sampled during the run",
    )


def read_series_file(path: Path) -> DevicePeak:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise BadInputError(
            f"--memory-series {str(path)!r} cannot be read: {err.strerror or err}",
            hint=SERIES_HINT,
        ) from None
    return read_memory_series(text, str(path))


@dataclass(frozen=True, slots=True)
class BackOff:
    """The next pinned KV after an OOM (`pretuner.pinned.back_off_bytes`)."""

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

    def lines(self) -> list[str]:
        about = "" if self.kv_tokens_exact else "about "
        out = []
        if self.kv_tokens is not None:
            conc = self.max_concurrency
            at = f"; {conc:.2f}x at max_model_len {self.max_model_len:,}" if conc else ""
            out.append(f"KV tokens at {self.kv_bytes // MIB:,} MiB: {about}{self.kv_tokens:,} "
                       f"(derived){at}")
        gain = self.gain_bytes
        if self.basis.startswith("log:"):  # the KV the log's run held: no peak to go further
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
            **pick(self, "flag", "basis", "kv_tokens", "kv_tokens_exact"),
            "max_concurrency": None if conc is None else round(conc, 2),
            **pick(self, "held_kv_bytes", "held_kv_tokens", "gain_bytes", "gain_tokens"),
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
    tp: int
    pp: int
    bytes_per_token: int | None
    held_kv_bytes: int | None  # the KV cache the run held
    series: DevicePeak | None
    total_mib: int | None
    budget: PinnedBudget | None  # with a measured peak and a total
    back_off: BackOff | None  # after an OOM
    suggestion: Suggestion | None
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    next_step: str
    provenance: dict[str, str]

    def text(self) -> str:
        """The log's figures with their provenance, then the arithmetic."""
        log = self.log
        rows: list[tuple[str, str]] = []
        if log.weights_gib is not None:
            rows.append(("weights", f"{log.weights_gib:.2f} GiB"))
        if log.kv_gib is not None and self.kv_mode is not None:
            kv = f"{log.kv_gib:.2f} GiB, {self.kv_mode}"
            if self.kv_mode == "pinned" and self.kv_in_log_bytes is not None:
                kv += f" (--kv-cache-memory-bytes {self.kv_in_log_bytes})"
            elif self.kv_mode == "profiled":
                kv += " (what profiling left under --gpu-memory-utilization)"
            rows.append(("KV cache", kv))
        if log.kv_tokens is not None:
            rows.append(("KV tokens", f"{log.kv_tokens:,}"))
        if log.max_concurrency is not None:
            at = f" at max_model_len {log.max_model_len:,}" if log.max_model_len else ""
            rows.append(("concurrency", f"{log.max_concurrency:.2f}x{at}"))
        if log.graphs_gib is not None:
            rows.append(("graph capture", f"{log.graphs_gib:.2f} GiB (after the KV allocation)"))
        if log.non_kv_gib is not None:
            rows.append(("non-KV (profiled)", f"{log.non_kv_gib:.2f} GiB"))
        if log.max_num_batched_tokens is not None:
            rows.append(("max_num_batched_tokens", f"{log.max_num_batched_tokens:,}"))
        if self.oom_phase is not None:
            alloc = log.oom_alloc_bytes
            size = "size not printed" if alloc is None else f"{alloc / MIB:,.1f} MiB"
            rows.append(("out of memory", f"{size} at {self.oom_phase}: {log.oom_text}"))
        if log.estimated_max_len is not None:
            rows.append(("longest sequence", f"{log.estimated_max_len:,} tokens (estimated)"))
        lines = [
            f"V1 engine log: {', '.join(self.files)}",
            f"outcome: {self.outcome}",
            "",
            "what the log shows (measured from the log):",
        ]
        width = max((len(k) for k, _ in rows), default=0)
        lines += [f"  {k.ljust(width)}  {val}" for k, val in rows]
        if self.bytes_per_token is not None:
            lines.append(f"KV bytes/token: {self.bytes_per_token:,} B, "
                         f"{self.provenance['kv_bytes_per_token']}")
        if self.held_kv_bytes is not None:
            held = f"{self.held_kv_bytes / MIB:,.1f} MiB ({self.held_kv_bytes / GIB:.2f} GiB)"
            held_source = self.provenance["held_kv_bytes"]
            if (held_source == HELD_FROM_TOKENS and log.kv_tokens is not None
                    and self.bytes_per_token):
                lines.append(f"KV held = {log.kv_tokens:,} tokens x {self.bytes_per_token:,} B = "
                             f"{self.held_kv_bytes:,} B = {held}, derived")
            else:
                lines.append(f"KV held: {held}, {held_source}")
        if self.series is not None:
            phases = ", ".join(f"{k} {val:,}" for k, val in self.series.phase_peaks_mib.items())
            lines.append(
                f"device peak: {self.series.peak_mib:,} MiB over {self.series.samples:,} samples "
                f"(measured, {self.series.source} series {self.series.file})"
                + (f"; per phase, MiB: {phases}" if phases else "")
            )
        if self.total_mib is not None:
            lines.append(f"device total: {self.total_mib:,} MiB, {self.provenance['total_mib']}")
        lines.append("")
        if self.warnings:
            lines += [f"WARNING: {w}" for w in self.warnings] + [""]
        if self.budget is not None:
            lines.append("what the card could hold (from the measured device peak):")
            lines += [f"  {x}" for x in self.budget.lines()]
        elif self.back_off is not None:
            lines.append("what the next run can hold (back-off from the out-of-memory error):")
            lines += [f"  {x}" for x in self.back_off.lines()]
        elif self.suggestion is not None:
            lines.append("what the log proves (no device peak):")
        if self.suggestion is not None:
            lines += [f"  {x}" for x in self.suggestion.lines()]
        lines += [f"note: {n}" for n in self.notes]
        if self.suggestion is not None:
            s = self.suggestion
            lines += ["", f"try:  {s.flag}  ({s.kv_bytes / GIB:.2f} GiB, {s.basis})"]
        lines.append(f"next: {self.next_step}")
        return "\n".join(lines)

    def out_text(self, command: str) -> str:
        """The flag to try, with where it comes from."""
        lines = [f"# {command} (V1 engine log)", f"# {self.outcome}"]
        if self.suggestion is None:
            lines.append("# no --kv-cache-memory-bytes to suggest: see the warnings")
        else:
            s = self.suggestion
            lines += [
                f"# {s.basis}: {s.kv_bytes / GIB:.2f} GiB; a candidate until validated",
                f"# {self.next_step}",
                s.flag,
            ]
        lines += [f"# warning: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"

    def json_warnings(self) -> list[str]:
        return []  # the object holds them

    def to_json(self) -> dict[str, Any]:
        log = self.log
        budget = self.budget
        return {
            "engine": "v1",
            "files": list(self.files),
            "outcome": self.outcome,
            **pick(log, "ready", "start_failed", "engine_dead", "weights_gib"),
            "kv_mode": self.kv_mode,
            "kv_gib": log.kv_gib,
            "kv_in_log_bytes": self.kv_in_log_bytes,
            **pick(log, "kv_tokens", "max_model_len", "max_concurrency", "graphs_gib"),
            "non_kv_gib_log": log.non_kv_gib,
            "max_num_batched_tokens": log.max_num_batched_tokens,
            "oom": None if self.oom_phase is None else {
                "alloc_bytes": log.oom_alloc_bytes,
                "text": log.oom_text,
                "phase": self.oom_phase,
            },
            **pick(log, "estimated_max_len", "no_kv_memory", "refused_free_gib"),
            **pick(self, "tp", "pp"),
            "kv_bytes_per_token": self.bytes_per_token,
            "held_kv_bytes": self.held_kv_bytes,
            "device": None if self.series is None else asdict(self.series),
            "total_mib": self.total_mib,
            "budget": None if budget is None else {
                "peak_mib": budget.peak_mib,
                "held_kv_bytes": self.held_kv_bytes,
                "held_kv_mib": round(budget.held_kv_mib, 1),
                "non_kv_mib": round(budget.non_kv_mib, 1),
                **pick(budget, "total_mib", "margin_mib", "kv_mib", "kv_bytes", "source"),
            },
            "back_off": None if self.back_off is None else asdict(self.back_off),
            "suggestion": None if self.suggestion is None else self.suggestion.to_json(),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "next_step": self.next_step,
            "provenance": self.provenance,
        }


def analyze_v1(cfg: AnalyzeConfig, log: V1Log, files: tuple[str, ...]) -> V1Analysis:
    """What the log shows, and the pinned KV that the measurements support."""
    series = read_series_file(cfg.memory_series) if cfg.memory_series is not None else None
    if log.kv_gib is None and log.kv_tokens is None and not log.failed_oom \
            and not log.no_kv_memory and log.refused_free_gib is None:
        raise NothingFoundError(
            f"the V1 log {', '.join(files)} shows no KV cache size and no failure",
            hint="pass the whole server log from its start (with the EngineCore/Worker lines "
            "at INFO level) up to the first requests",
        )
    warnings: list[str] = []
    notes: list[str] = []
    prov = {key: "measured (log)" for key in _LOG_FIGURES if getattr(log, key) is not None}
    tp = cfg.tp if cfg.tp is not None else log.tp or 1
    pp = cfg.pp if cfg.pp is not None else log.pp or 1
    kv_mode, kv_in_log = _kv_in_log(log)
    if kv_in_log is not None:
        prov["kv_in_log_bytes"] = ("measured (log: the echoed --kv-cache-memory-bytes)"
                                   if log.pinned_kv_bytes is not None else "measured (log, GiB)")
    bpt, bpt_exact, bpt_source = _bytes_per_token(cfg, log, kv_in_log, tp, pp, warnings)
    if bpt_source is not None:
        prov["kv_bytes_per_token"] = bpt_source
    held, held_source = _held_kv(log, kv_in_log, bpt, bpt_exact)
    if held_source is not None:
        prov["held_kv_bytes"] = held_source
    total_mib, total_source = _total(cfg, series, warnings)
    if total_mib is not None and series is not None and series.peak_mib > total_mib:
        raise BadInputError(
            f"the memory series peak {series.peak_mib:,} MiB is above the device total "
            f"{total_mib:,} MiB",
            hint="pass the device's own total as --card-total-mib (NVML memory.total)",
        )
    if series is not None and total_mib is None:
        raise BadInputError(
            f"--memory-series {series.file!r} gives the peak but not the device total",
            hint="pass --card-total-mib (NVML's memory.total, e.g. `nvidia-smi "
            "--query-gpu=memory.total --format=csv,noheader,nounits`: 81559 on an H100 80GB)",
        )
    if total_source is not None:
        prov["total_mib"] = total_source
    if series is not None:
        prov["device_peak_mib"] = f"measured ({series.source} series {series.file})"
        if len(series.runs) > 1:
            warnings.append(f"the memory series holds {len(series.runs)} runs "
                            f"({', '.join(series.runs)}): its peak is the highest of them; "
                            "pass the series of the run that wrote this log")
    oom_phase = _oom_phase(log)
    outcome = _outcome(log, oom_phase)

    budget: PinnedBudget | None = None
    back_off: BackOff | None = None
    suggestion: Suggestion | None = None
    kv_bytes: int | None = None
    basis: str | None = None
    device_oom = _device_oom(log)
    if device_oom and kv_in_log is not None:
        if series is not None:
            warnings.append(
                f"the memory series was not used: the run ran out of memory, so its peak "
                f"({series.peak_mib:,} MiB) is less than what the run needed"
            )
        margin_total, margin_basis = _margin_total(total_mib, log)
        back = back_off_bytes(kv_in_log, log.oom_alloc_bytes, margin_total)  # None: the margin
        back_off = BackOff(kv_in_log, log.oom_alloc_bytes, margin_mib(margin_total),
                           margin_basis, back)
        prov["back_off"] = "derived"
        if back > 0:
            kv_bytes, basis = back, "back-off"
        else:
            warnings.append(
                f"the failed allocation ({(log.oom_alloc_bytes or 0) / GIB:.2f} GiB) and the "
                f"margin leave no KV cache of the {kv_in_log / GIB:.2f} GiB the run asked for: "
                "give the engine more memory (or more devices)"
            )
        if oom_phase == "prefill" and log.max_num_batched_tokens:
            notes.append(
                f"or keep the KV and lower --max-num-batched-tokens "
                f"({log.max_num_batched_tokens:,} in this log): a prefill step's activations "
                "grow with it"
            )
    elif device_oom:
        warnings.append(f"the run ran out of memory ({log.oom_text}) before it printed its KV "
                        "cache size: nothing to back off from; pin a --kv-cache-memory-bytes "
                        "well below the free memory and measure again")
    elif log.ready and held is not None:
        if series is not None and total_mib is not None:
            budget = derive_pinned(total_mib, series.peak_mib, held, series.source)
            _check_budget(budget, log, warnings)
            kv_bytes, basis = budget.kv_bytes, "measured peak"
            prov["budget"] = "derived"
        else:
            warnings.append(
                "THE DEVICE PEAK WAS NOT MEASURED: what the card could hold beyond this run is "
                "unknown; pass --memory-series (an NVML series or repeated nvidia-smi CSV of "
                "this run) and --card-total-mib to derive it"
            )
            if kv_mode == "pinned" and kv_in_log is not None:
                kv_bytes, basis = kv_in_log, "log: ready run, pinned"
            else:
                # tokens x bytes/token is whole blocks: pinning it keeps every token; a GiB
                # figure from the log is rounded, so round it down
                exact = held_source == HELD_FROM_TOKENS
                kv_bytes = held if exact else held // MIB * MIB
                basis = "log: ready run, profiled KV pinned"
                notes.append("pinning the KV that profiling gave keeps this run's cache, and "
                             "a later start with less free memory cannot shrink it")
    elif not (log.ready or log.start_failed or log.no_kv_memory or log.estimated_max_len
              or log.refused_free_gib is not None):
        warnings.append("the log shows neither the server ready nor an out-of-memory error: "
                        "was it cut short? pass the whole log")
    if log.no_kv_memory:
        warnings.append("the engine found no memory for the KV cache blocks: the weights and "
                        "activations alone fill the device; use more devices (TP) or a "
                        "smaller model")
    if log.estimated_max_len is not None:
        notes.append(f"the KV cache holds at most {log.estimated_max_len:,} tokens of one "
                     "sequence: lower --max-model-len to it, or give the KV cache more memory")
    if log.refused_free_gib is not None:
        warnings.append(
            f"the engine refused to start: only {log.refused_free_gib:.2f} GiB was free and "
            "--gpu-memory-utilization asked more; lower it, or pin --kv-cache-memory-bytes"
        )
    if kv_bytes is not None and basis is not None:
        suggestion = Suggestion(kv_bytes, basis, kv_tokens(kv_bytes, bpt, cfg.block_size)
                                if bpt else None, bpt_exact, held, log.kv_tokens,
                                log.max_model_len)
    return V1Analysis(
        files=files,
        outcome=outcome,
        oom_phase=oom_phase,
        log=log,
        kv_mode=kv_mode,
        kv_in_log_bytes=kv_in_log,
        tp=tp,
        pp=pp,
        bytes_per_token=bpt,
        held_kv_bytes=held,
        series=series,
        total_mib=total_mib,
        budget=budget,
        back_off=back_off,
        suggestion=suggestion,
        warnings=tuple(warnings),
        notes=tuple(notes),
        next_step=_next_step(cfg, log, suggestion, tp),
        provenance=prov,
    )


def _kv_in_log(log: V1Log) -> tuple[str | None, int | None]:
    """The KV cache the run asked for: pinned (exact when echoed), else what profiling gave."""
    if log.pinned_kv_bytes is not None:
        return "pinned", log.pinned_kv_bytes
    if log.pinned_kv_gib is not None:
        return "pinned", int(log.pinned_kv_gib * GIB)
    if log.available_kv_gib is not None:
        return "profiled", int(log.available_kv_gib * GIB)
    return None, None


def _bytes_per_token(cfg: AnalyzeConfig, log: V1Log, kv_in_log: int | None, tp: int, pp: int,
                     warnings: list[str]) -> tuple[int | None, bool, str | None]:
    """KV bytes per token on one device, whether it is exact, and where it comes from."""
    if cfg.model is not None:
        bpt = kv_bytes_per_token(cfg.model, tp=tp, pp=pp, kv_dtype=cfg.kv_cache_dtype)
        if log.kv_tokens and kv_in_log:
            share = log.kv_tokens * bpt / kv_in_log - 1
            if abs(share) > MISMATCH_SHARE:
                warnings.append(
                    f"--model {cfg.model.name} at TP{tp} gives {bpt:,} B/token, so the log's "
                    f"{log.kv_tokens:,} tokens would be {log.kv_tokens * bpt / GIB:.2f} GiB, "
                    f"{share:+.1%} off the log's {kv_in_log / GIB:.2f} GiB: check --model, "
                    "--tp and --kv-cache-dtype"
                )
        return bpt, True, (f"derived from --model {cfg.model.name} (TP{tp}, PP{pp}, "
                           f"KV dtype {cfg.kv_cache_dtype})")
    if log.kv_tokens and kv_in_log:
        return (round(kv_in_log / log.kv_tokens), False,
                "derived from the log: KV bytes / KV tokens (approximate: pass --model for the "
                "exact figure)")
    return None, False, None


def _held_kv(
    log: V1Log, kv_in_log: int | None, bpt: int | None, exact: bool
) -> tuple[int | None, str | None]:
    """The KV cache the run held, and where the figure comes from."""
    if exact and bpt is not None and log.kv_tokens is not None:
        return kv_held_bytes(log.kv_tokens, bpt, None), HELD_FROM_TOKENS
    if kv_in_log is not None:
        return kv_in_log, "measured (log: the KV size it printed)"
    return None, None


def _total(cfg: AnalyzeConfig, series: DevicePeak | None,
           warnings: list[str]) -> tuple[int | None, str | None]:
    measured = series.total_mib if series is not None else None
    if cfg.card_total_mib is not None:
        if measured is not None and measured != cfg.card_total_mib:
            warnings.append(f"the memory series says the device total is {measured:,} MiB; "
                            f"using the given --card-total-mib {cfg.card_total_mib:,}")
        return cfg.card_total_mib, "given (--card-total-mib)"
    if series is not None and measured is not None:
        return measured, f"measured ({series.source} series' device total)"
    return None, None


def _margin_total(total_mib: int | None, log: V1Log) -> tuple[int, str]:
    """The device size the margin is a share of, and how it was chosen."""
    if total_mib is not None:
        return total_mib, "0.5 % of the device total"
    if log.initial_free_gib is not None:
        return (int(log.initial_free_gib * 1024),
                f"0.5 % of the initial free memory {log.initial_free_gib:.2f} GiB in the log; "
                "pass --card-total-mib for the device's")
    return 0, f"the floor {MARGIN_FLOOR_MIB} MiB; pass --card-total-mib for 0.5 % of the device"


def _device_oom(log: V1Log) -> bool:
    """An allocation the device refused (not the engine's own "does not fit" checks)."""
    if log.oom_alloc_bytes is not None:
        return True
    return log.oom_text is not None and not log.no_kv_memory and log.estimated_max_len is None


def _oom_phase(log: V1Log) -> str | None:
    if not _device_oom(log):
        return None
    if log.ready:
        return "prefill" if log.prefill_died else "serving"
    return "start-up"


def _outcome(log: V1Log, oom_phase: str | None) -> str:
    oom = f"out of memory ({log.oom_text})" if log.oom_text else "out of memory"
    if oom_phase == "start-up":
        when = " after the KV cache was sized" if log.kv_tokens is not None else ""
        return f"never ready: {oom} at start-up{when}"
    if oom_phase == "prefill":
        return (f"ready, then the engine died on a prefill step: {oom}; every request failed "
                "from then on")
    if oom_phase == "serving":
        dead = "the engine died" if log.engine_dead else "a request failed"
        return f"ready, then {dead} while serving: {oom}"
    if log.refused_free_gib is not None:
        return "never ready: the engine refused the --gpu-memory-utilization asked"
    if log.no_kv_memory:
        return "never ready: no memory left for the KV cache blocks"
    if log.estimated_max_len is not None:
        return (f"never ready: one max_model_len sequence does not fit the KV cache (at most "
                f"{log.estimated_max_len:,} tokens)")
    if log.start_failed:
        return "never ready: the engine failed to start (no out-of-memory error in the log)"
    if log.engine_dead:
        return "ready, then the engine died while serving (no out-of-memory error in the log)"
    if log.ready:
        return "ready; no out-of-memory error in the log"
    return "not ready in this log (cut short?)"


def _check_budget(budget: PinnedBudget, log: V1Log, warnings: list[str]) -> None:
    if budget.non_kv_mib <= 0:
        raise BadInputError(
            f"the memory series peak {budget.peak_mib:,} MiB is below the KV cache the log held "
            f"({budget.held_kv_mib:,.1f} MiB): the series is not of this run",
            hint="pass the series sampled during the run that wrote this log",
        )
    if log.weights_gib is not None and budget.non_kv_mib < log.weights_gib * 1024:
        raise BadInputError(
            f"the non-KV peak from the memory series ({budget.non_kv_mib:,.1f} MiB) is below "
            f"the weights the log loaded ({log.weights_gib:.2f} GiB): the series is not of "
            "this run",
            hint="pass the series sampled during the run that wrote this log",
        )
    if budget.kv_mib == 0:
        warnings.append("the measured non-KV peak leaves no room for a KV cache on this device")


def _next_step(cfg: AnalyzeConfig, log: V1Log, suggestion: Suggestion | None, tp: int) -> str:
    argv = ["pretuner", "run", "--engine", "vllm", "--model",
            cfg.model.name if cfg.model is not None else "MODEL"]
    if log.max_model_len is not None:
        argv += ["--max-model-len", str(log.max_model_len)]
    if log.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(log.max_num_batched_tokens)]
    if tp > 1:
        argv += ["--tp", str(tp)]
    if suggestion is None:
        return "fix what failed above, then measure on the card: " + shlex.join(argv)
    return (f"{suggestion.flag} is a candidate until a run under the worst-case request "
            "(max_model_len prompts at full concurrency) proves it; this measures and "
            f"validates the pinned KV on the card: {shlex.join(argv)}")
