"""`analyze` on a V1 engine's log (vLLM >= 0.8 on CUDA and CPU, vllm-ascend, vLLM-MindSpore >=
0.3): what the run shows, and the `--kv-cache-memory-bytes` to try next.

With a device memory series of the run and the device total, the measured non-KV peak says
what the card could hold (`pretuner.pinned.derive_pinned`). Without one, only what the log
proves: a run that was ready holds its KV cache (pinning it keeps it), and a run that ran out
of memory needs less KV by the allocation that failed, the CUDA graph memory still to come when
it died capturing graphs, and the margin (`back_off_bytes`).
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
from pretuner.engines.base import KV_FLAG
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
_NOT_THIS_RUN = "pass the series sampled during the run that wrote this log"


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
            hint="pass the NVML series (TSV) or nvidia-smi CSV sampled during the run",
        ) from None
    return read_memory_series(text, str(path))


def graphs_to_come(log: V1Log) -> tuple[int | None, str | None]:
    """The CUDA graph memory a run that ran out of memory while capturing graphs had still to
    allocate, and how it was found: (None, None) when no capture was under way, (None, why)
    when the log does not say how much was captured."""
    done = sum(graphs for _, graphs, _ in log.graph_capture)
    total = sum(graphs for _, _, graphs in log.graph_capture)
    pools = log.graph_pool_bytes
    if log.graphs_gib is not None or done >= total:
        return None, None
    if log.graphs_estimated_gib is not None:
        return (max(0, int(log.graphs_estimated_gib * GIB) - (pools or 0)),
                f"the engine's estimate {log.graphs_estimated_gib:.2f} GiB less the "
                f"{(pools or 0) / MIB:,.1f} MiB in graph pools, derived")
    if pools is None:
        return None, ("the run ran out of memory while capturing CUDA graphs and the log does "
                      "not say how much graph memory was still to come: the back-off covers "
                      "the failed allocation only, so it may not be enough")
    # vLLM captures the largest batch sizes first: the graphs left cost at most this rate
    return (pools * (total - done) // max(done, 1),
            f"{pools / MIB:,.1f} MiB in graph pools for {done} of {total} graphs, the "
            f"{total - done} left at that rate, derived")


@dataclass(frozen=True, slots=True)
class BackOff:
    """The next pinned KV after an OOM (`pretuner.pinned.back_off_bytes`)."""

    from_kv_bytes: int
    alloc_bytes: int | None
    margin_mib: int
    margin_basis: str
    kv_bytes: int
    graphs_to_come_bytes: int | None = None  # the OOM struck while graphs were captured
    graphs_basis: str | None = None

    def line(self) -> str:
        alloc = "no size in the OOM" if self.alloc_bytes is None else "failed allocation"
        graphs = "" if self.graphs_to_come_bytes is None else (
            f" - graph capture still to come {self.graphs_to_come_bytes / MIB:,.1f} MiB "
            f"({self.graphs_basis})")
        return (f"back-off = KV in the log {self.from_kv_bytes / MIB:,.1f} MiB (measured) - "
                f"{alloc} {(self.alloc_bytes or 0) / MIB:,.1f} MiB (measured){graphs} - margin "
                f"{self.margin_mib:,} MiB ({self.margin_basis}) = {self.kv_bytes // MIB:,} MiB "
                f"({self.kv_bytes / GIB:.2f} GiB, derived), rounded down to a MiB")


@dataclass(frozen=True, slots=True)
class Suggestion:
    """The `--kv-cache-memory-bytes` to try, and what it was derived from."""

    kv_bytes: int
    basis: str  # "measured peak", "log: ready run, ...", "back-off"
    derived_from: str  # the files and figures it comes from, in words
    kv_tokens: int | None  # at the analysis' bytes/token; None when that is not known

    @property
    def flag(self) -> str:
        return f"{KV_FLAG} {self.kv_bytes}"


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
    kv_tokens_exact: bool  # False when the bytes/token was derived from a rounded GiB figure
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

    def _rows(self) -> list[tuple[str, str]]:
        """What the log shows: (label, value) for each figure it says."""
        log, mode, alloc = self.log, self.kv_mode, self.log.oom_alloc_bytes
        how = {"pinned": f" ({KV_FLAG} {self.kv_in_log_bytes})",
               "profiled": " (what profiling left under --gpu-memory-utilization)"}
        at = f" at max_model_len {log.max_model_len:,}" if log.max_model_len else ""
        size = "size not printed" if alloc is None else f"{alloc / MIB:,.1f} MiB"
        oom = self.oom_phase and f"{size} at {self.oom_phase}: {log.oom_text}"
        rows = (  # label, figure (None: not in the log), its format
            ("weights", log.weights_gib, "{:.2f} GiB"),
            ("KV cache", mode and log.kv_gib, f"{{:.2f}} GiB, {mode}{how.get(mode or '')}"),
            ("KV tokens", log.kv_tokens, "{:,}"),
            ("concurrency", log.max_concurrency, "{:.2f}x" + at),
            ("graph capture", log.graphs_gib, "{:.2f} GiB (after the KV allocation)"),
            ("non-KV (profiled)", log.non_kv_gib, "{:.2f} GiB"),
            ("max_num_batched_tokens", log.max_num_batched_tokens, "{:,}"),
            ("out of memory", oom, "{}"),
            ("longest sequence", log.estimated_max_len, "{:,} tokens (estimated)"),
        )
        return [(label, fmt.format(figure)) for label, figure, fmt in rows if figure is not None]

    def _gains(self, s: Suggestion) -> tuple[int | None, int | None, float | None]:
        """The suggestion's gain over the log's run in bytes and tokens, and its concurrency."""
        held, tokens, length = self.held_kv_bytes, self.log.kv_tokens, self.log.max_model_len
        return (None if held is None else s.kv_bytes - held,
                None if s.kv_tokens is None or tokens is None else s.kv_tokens - tokens,
                s.kv_tokens / length if s.kv_tokens is not None and length else None)

    def _suggestion_lines(self, s: Suggestion) -> list[str]:
        about = "" if self.kv_tokens_exact else "about "
        gain, gain_tokens, conc = self._gains(s)
        out = []
        if s.kv_tokens is not None:
            at = f"; {conc:.2f}x at max_model_len {self.log.max_model_len:,}" if conc else ""
            out.append(f"KV tokens at {s.kv_bytes // MIB:,} MiB: {about}{s.kv_tokens:,} "
                       f"(derived){at}")
        if s.basis.startswith("log:"):  # the KV the log's run held: no peak to go further
            out.append("the KV cache of the log's run, pinned: no gain until the device peak "
                       "is measured")
        elif gain is not None and self.held_kv_bytes is not None:
            line = (f"gain vs the log: {s.kv_bytes / MIB:,.1f} MiB - "
                    f"{self.held_kv_bytes / MIB:,.1f} MiB = {gain / MIB:+,.1f} MiB "
                    f"({gain / GIB:+.2f} GiB)")
            if gain_tokens is not None:
                line += (f", {s.kv_tokens:,} - {self.log.kv_tokens:,} tokens = "
                         f"{about}{gain_tokens:+,} tokens")
            out.append(line)
        return out

    def _suggestion_json(self, s: Suggestion) -> dict[str, Any]:
        gain, gain_tokens, conc = self._gains(s)
        return {
            "kv_bytes": s.kv_bytes,
            "kv_mib": s.kv_bytes // MIB,
            "kv_gib": round(s.kv_bytes / GIB, 2),
            **pick(s, "flag", "basis", "derived_from", "kv_tokens"),
            "kv_tokens_exact": self.kv_tokens_exact,
            "max_concurrency": None if conc is None else round(conc, 2),
            "held_kv_bytes": self.held_kv_bytes,
            "held_kv_tokens": self.log.kv_tokens,
            "gain_bytes": gain,
            "gain_tokens": gain_tokens,
        }

    def text(self) -> str:
        """The log's figures with their provenance, then the arithmetic."""
        log, prov, series, s = self.log, self.provenance, self.series, self.suggestion
        rows = self._rows()
        width = max((len(k) for k, _ in rows), default=0)
        lines = [f"V1 engine log: {', '.join(self.files)}", f"outcome: {self.outcome}", "",
                 "what the log shows (measured from the log):",
                 *(f"  {k.ljust(width)}  {val}" for k, val in rows)]
        if self.bytes_per_token is not None:
            lines.append(f"KV bytes/token: {self.bytes_per_token:,} B, "
                         f"{prov['kv_bytes_per_token']}")
        if self.held_kv_bytes is not None:
            held = f"{self.held_kv_bytes / MIB:,.1f} MiB ({self.held_kv_bytes / GIB:.2f} GiB)"
            if prov["held_kv_bytes"] == HELD_FROM_TOKENS:
                lines.append(f"KV held = {log.kv_tokens:,} tokens x {self.bytes_per_token:,} B = "
                             f"{self.held_kv_bytes:,} B = {held}, derived")
            else:
                lines.append(f"KV held: {held}, {prov['held_kv_bytes']}")
        if series is not None:
            phases = ", ".join(f"{k} {val:,}" for k, val in series.phase_peaks_mib.items())
            lines.append(f"device peak: {series.peak_mib:,} MiB over {series.samples:,} samples "
                         f"(measured, {series.source} series {series.file})"
                         + (f"; per phase, MiB: {phases}" if phases else ""))
        if self.total_mib is not None:
            lines.append(f"device total: {self.total_mib:,} MiB, {prov['total_mib']}")
        lines += ["", *(f"WARNING: {w}" for w in self.warnings), *([""] if self.warnings else [])]
        if self.budget is not None:
            lines.append("what the card could hold (from the measured device peak):")
            lines += [f"  {x}" for x in self.budget.lines()]
        elif self.back_off is not None:
            lines.append("what the next run can hold (back-off from the out-of-memory error):")
            lines.append(f"  {self.back_off.line()}")
        elif s is not None:
            lines.append("what the log proves (no device peak):")
        lines += [f"  {x}" for x in (self._suggestion_lines(s) if s is not None else [])]
        lines += [f"note: {n}" for n in self.notes]
        if s is not None:
            lines += ["", f"try:  {s.flag}  ({s.kv_bytes / GIB:.2f} GiB, {s.basis}: "
                      f"{s.derived_from})"]
        return "\n".join([*lines, f"next: {self.next_step}"])

    def out_text(self, command: str) -> str:
        """The flag to try, with where it comes from."""
        lines = [f"# {command} (V1 engine log)", f"# {self.outcome}"]
        s = self.suggestion
        if s is None:
            lines.append("# no --kv-cache-memory-bytes to suggest: see the warnings")
        else:
            lines += [f"# {s.basis}: {s.kv_bytes / GIB:.2f} GiB, {s.derived_from}; a candidate "
                      "until validated", f"# {self.next_step}", s.flag]
        lines += [f"# warning: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"

    def json_warnings(self) -> list[str]:
        return []  # the object holds them

    def to_json(self) -> dict[str, Any]:
        log, budget, s = self.log, self.budget, self.suggestion
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
            "suggestion": None if s is None else self._suggestion_json(s),
            **pick(self, "warnings", "notes", "next_step", "provenance"),
        }


def analyze_v1(cfg: AnalyzeConfig, log: V1Log, files: tuple[str, ...],
               series: DevicePeak | None) -> V1Analysis:
    """What the log shows, and the pinned KV that the measurements support."""
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
    # the KV cache the run asked for: pinned (exact when echoed), else what profiling gave
    pinned = log.pinned_kv_bytes is not None or log.pinned_kv_gib is not None
    kv_mode = "pinned" if pinned else None if log.available_kv_gib is None else "profiled"
    kv_in_log = log.pinned_kv_bytes if log.pinned_kv_bytes is not None else (
        None if log.kv_gib is None else int(log.kv_gib * GIB))
    if kv_in_log is not None:
        prov["kv_in_log_bytes"] = ("measured (log: the echoed --kv-cache-memory-bytes)"
                                   if log.pinned_kv_bytes is not None else "measured (log, GiB)")
    bpt, bpt_exact, bpt_source = _bytes_per_token(cfg, log, kv_in_log, tp, pp, warnings)
    if bpt_source is not None:
        prov["kv_bytes_per_token"] = bpt_source
    held: int | None = kv_in_log
    if bpt_exact and bpt is not None and log.kv_tokens is not None:
        held, prov["held_kv_bytes"] = kv_held_bytes(log.kv_tokens, bpt, None), HELD_FROM_TOKENS
    elif kv_in_log is not None:
        prov["held_kv_bytes"] = "measured (log: the KV size it printed)"
    total_mib = _total(cfg, series, warnings, prov)
    if series is not None:
        prov["device_peak_mib"] = f"measured ({series.source} series {series.file})"
        if len(series.runs) > 1:
            warnings.append(f"the memory series holds {len(series.runs)} runs "
                            f"({', '.join(series.runs)}): its peak is the highest of them; "
                            "pass the series of the run that wrote this log")
    oom_phase = _oom_phase(log)
    names = ", ".join(Path(f).name for f in files)
    budget: PinnedBudget | None = None
    back_off: BackOff | None = None
    kv_bytes: int | None = None
    basis = derived_from = ""
    if oom_phase is not None and kv_in_log is not None:
        if series is not None:
            warnings.append(
                f"the memory series was not used: the run ran out of memory, so its peak "
                f"({series.peak_mib:,} MiB) is less than what the run needed"
            )
        back_off = _back_off(log, kv_in_log, total_mib, warnings)
        prov["back_off"] = "derived"
        if back_off.kv_bytes > 0:
            kv_bytes, basis = back_off.kv_bytes, "back-off"
            derived_from = (f"derived from {names}: its KV {kv_in_log / GIB:.2f} GiB less the "
                            "failed allocation"
                            + (", the graph capture still to come"
                               if back_off.graphs_to_come_bytes is not None else "")
                            + " and the margin")
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
    elif oom_phase is not None:
        warnings.append(f"the run ran out of memory ({log.oom_text}) before it printed its KV "
                        "cache size: nothing to back off from; pin a --kv-cache-memory-bytes "
                        "well below the free memory and measure again")
    elif log.ready and held is not None:
        if series is not None and total_mib is not None:
            budget = derive_pinned(total_mib, series.peak_mib, held, series.source)
            _check_budget(budget, log, warnings)
            kv_bytes, basis = budget.kv_bytes, "measured peak"
            derived_from = (f"derived from the device peak in {Path(series.file).name} and the "
                            f"KV cache {names} held")
            prov["budget"] = "derived"
        else:
            warnings.append(
                "THE DEVICE PEAK WAS NOT MEASURED: what the card could hold beyond this run is "
                "unknown; pass --memory-series (an NVML series or repeated nvidia-smi CSV of "
                "this run) and --card-total-mib to derive it"
            )
            derived_from = f"the KV cache of the ready run in {names}"
            if kv_mode == "pinned" and kv_in_log is not None:
                kv_bytes, basis = kv_in_log, "log: ready run, pinned"
            else:
                # tokens x bytes/token is whole blocks: pinning it keeps every token; a GiB
                # figure from the log is rounded, so round it down
                kv_bytes = held if prov["held_kv_bytes"] == HELD_FROM_TOKENS else held // MIB * MIB
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
    tokens = kv_tokens(kv_bytes, bpt, cfg.block_size) if kv_bytes is not None and bpt else None
    suggestion = None if kv_bytes is None else Suggestion(kv_bytes, basis, derived_from, tokens)
    return V1Analysis(
        files=files,
        outcome=_outcome(log, oom_phase),
        oom_phase=oom_phase,
        log=log,
        kv_mode=kv_mode,
        kv_in_log_bytes=kv_in_log,
        tp=tp,
        pp=pp,
        bytes_per_token=bpt,
        kv_tokens_exact=bpt_exact,
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


def _total(cfg: AnalyzeConfig, series: DevicePeak | None, warnings: list[str],
           prov: dict[str, str]) -> int | None:
    """The device total: given, else the series'; checked against the series' peak."""
    measured = series.total_mib if series is not None else None
    total = cfg.card_total_mib if cfg.card_total_mib is not None else measured
    if cfg.card_total_mib is not None:
        if measured is not None and measured != cfg.card_total_mib:
            warnings.append(f"the memory series says the device total is {measured:,} MiB; "
                            f"using the given --card-total-mib {cfg.card_total_mib:,}")
        prov["total_mib"] = "given (--card-total-mib)"
    elif series is not None and measured is not None:
        prov["total_mib"] = f"measured ({series.source} series' device total)"
    if total is not None and series is not None and series.peak_mib > total:
        raise BadInputError(
            f"the memory series peak {series.peak_mib:,} MiB is above the device total "
            f"{total:,} MiB",
            hint="pass the device's own total as --card-total-mib (NVML memory.total)",
        )
    if series is not None and total is None:
        raise BadInputError(
            f"--memory-series {series.file!r} gives the peak but not the device total",
            hint="pass --card-total-mib (NVML's memory.total, e.g. `nvidia-smi "
            "--query-gpu=memory.total --format=csv,noheader,nounits`: 81559 on an H100 80GB)",
        )
    return total


def _back_off(log: V1Log, kv_in_log: int, total_mib: int | None,
              warnings: list[str]) -> BackOff:
    """Back off from the KV the run asked for by what it still needed when it died."""
    if total_mib is not None:
        margin_total, margin_basis = total_mib, "0.5 % of the device total"
    elif log.capacity_gib is not None:
        margin_total = int(log.capacity_gib * 1024)
        margin_basis = (f"0.5 % of the device total {log.capacity_gib:.2f} GiB in the OOM "
                        "message; pass --card-total-mib for the device's own")
    elif log.initial_free_gib is not None:
        margin_total = int(log.initial_free_gib * 1024)
        margin_basis = (f"0.5 % of the initial free memory {log.initial_free_gib:.2f} GiB in "
                        "the log; pass --card-total-mib for the device's")
    else:
        margin_total = 0
        margin_basis = (f"the floor {MARGIN_FLOOR_MIB} MiB; pass --card-total-mib for 0.5 % of "
                        "the device")
    to_come, graphs_basis = graphs_to_come(log)
    if to_come is None and graphs_basis is not None:
        warnings.append(graphs_basis)
    kv = back_off_bytes(kv_in_log, (log.oom_alloc_bytes or 0) + (to_come or 0), margin_total)
    return BackOff(kv_in_log, log.oom_alloc_bytes, margin_mib(margin_total), margin_basis, kv,
                   to_come, graphs_basis if to_come is not None else None)


def _oom_phase(log: V1Log) -> str | None:
    """When an allocation the device refused struck (not the engine's own "does not fit")."""
    device_oom = log.oom_alloc_bytes is not None or (
        log.oom_text is not None and not log.no_kv_memory and log.estimated_max_len is None)
    if not device_oom:
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
            f"({budget.held_kv_mib:,.1f} MiB): the series is not of this run", hint=_NOT_THIS_RUN)
    if log.weights_gib is not None and budget.non_kv_mib < log.weights_gib * 1024:
        raise BadInputError(
            f"the non-KV peak from the memory series ({budget.non_kv_mib:,.1f} MiB) is below "
            f"the weights the log loaded ({log.weights_gib:.2f} GiB): the series is not of "
            "this run", hint=_NOT_THIS_RUN)
    if budget.kv_mib == 0:
        warnings.append("the measured non-KV peak leaves no room for a KV cache on this device")


def _next_step(cfg: AnalyzeConfig, log: V1Log, suggestion: Suggestion | None, tp: int) -> str:
    argv = ["pretuner", "run", "--engine", "vllm", "--model",
            cfg.model.name if cfg.model is not None else "MODEL"]
    for flag, value in (("--max-model-len", log.max_model_len),
                        ("--max-num-batched-tokens", log.max_num_batched_tokens),
                        ("--tp", tp if tp > 1 else None)):
        argv += [] if value is None else [flag, str(value)]
    if suggestion is None:
        return "fix what failed above, then measure on the card: " + shlex.join(argv)
    return (f"{suggestion.flag} is a candidate until a run under the worst-case request "
            "(max_model_len prompts at full concurrency) proves it; this measures and "
            f"validates the pinned KV on the card: {shlex.join(argv)}")
