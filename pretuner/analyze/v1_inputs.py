"""The inputs of `analyze` on a V1 engine's log: what its lines say beyond `read_v1_log`
(the exact pinned bytes, max_model_len, the layout, the step that killed the engine) and the
device peak of a memory series sampled during the run. Pure: texts in, typed values out."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pretuner.devices.nvidia import parse_nvidia_smi_csv, parse_nvml_series, series_peaks
from pretuner.devices.series import parse_memory_tsv
from pretuner.engines.v1_log import V1Log, read_v1_log
from pretuner.errors import BadInputError

# Lines only a V1 engine writes about its KV cache (any one makes a log a V1 log).
V1_MARKERS = (
    "Available KV cache memory",
    "memory for KV Cache",
    "KV cache size:",
    "GiB for KV cache",
    "Initializing a V1 LLM engine",
)
# A MindSpore pool dump: the r0.1 method's input. A log with one is never read as V1.
POOL_DUMP_MARKERS = ("actual peak used mem", "DumpDynamicMemPoolStateInfo")

# The exact pinned bytes, as the API server echoes the flag: "'kv_cache_memory_bytes': 63350767616"
_PINNED_BYTES = re.compile(r"'kv_cache_memory_bytes': (\d+)")
_MAX_LEN = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request|"
                      r"Using max model len (\d+)|'max_model_len': (\d+)")
_TP = re.compile(r"tensor_parallel_size=(\d+)")
_PP = re.compile(r"pipeline_parallel_size=(\d+)")
# vLLM dumps the scheduler output of the step that killed the engine: new requests in it mean
# the step was a prefill.
_PREFILL_DUMP = "scheduled_new_reqs=[NewRequestData("


@dataclass(frozen=True, slots=True)
class V1Run:
    """One run's V1 log: the reader's facts plus the few lines it does not keep."""

    files: tuple[str, ...]
    log: V1Log
    pinned_kv_bytes: int | None  # --kv-cache-memory-bytes exactly, from the echoed arguments
    max_model_len: int | None
    tp: int | None
    pp: int | None
    v1_lines: bool  # a line only a V1 engine writes
    pool_dump: bool  # a MindSpore pool dump: the r0.1 method's log
    prefill_died: bool  # the step that killed the engine scheduled new requests

    @property
    def is_v1(self) -> bool:
        return self.v1_lines and not self.pool_dump


def read_v1_run(lines: Iterable[str], files: tuple[str, ...]) -> V1Run:
    """Every memory fact of one run's V1 log(s), in one pass over their lines."""
    seen: dict[str, Any] = {}

    def watch() -> Iterator[str]:
        for line in lines:
            _watch_line(line, seen)
            yield line

    log = read_v1_log(watch())
    return V1Run(
        files=files,
        log=log,
        pinned_kv_bytes=seen.get("pinned_kv_bytes"),
        max_model_len=seen.get("max_model_len"),
        tp=seen.get("tp"),
        pp=seen.get("pp"),
        v1_lines=bool(seen.get("v1_lines")),
        pool_dump=bool(seen.get("pool_dump")),
        prefill_died=bool(seen.get("prefill_died")),
    )


def _watch_line(line: str, seen: dict[str, Any]) -> None:
    if not seen.get("v1_lines") and any(m in line for m in V1_MARKERS):
        seen["v1_lines"] = True
    if not seen.get("pool_dump") and any(m in line for m in POOL_DUMP_MARKERS):
        seen["pool_dump"] = True
    if _PREFILL_DUMP in line and "Dumping scheduler output" in line:
        seen["prefill_died"] = True
    if "pinned_kv_bytes" not in seen and (m := _PINNED_BYTES.search(line)) is not None:
        seen["pinned_kv_bytes"] = int(m.group(1))
    if "max_model_len" not in seen and (m := _MAX_LEN.search(line)) is not None:
        digits = next(g for g in m.groups() if g is not None)
        seen["max_model_len"] = int(digits.replace(",", ""))
    for pattern, key in ((_TP, "tp"), (_PP, "pp")):
        if key not in seen and (m := pattern.search(line)) is not None:
            seen[key] = int(m.group(1))


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

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "source": self.source,
            "samples": self.samples,
            "peak_mib": self.peak_mib,
            "total_mib": self.total_mib,
            "phase_peaks_mib": self.phase_peaks_mib,
            "runs": list(self.runs),
        }


def read_memory_series(text: str, file: str) -> DevicePeak:
    """The device peak of a pretuner launch's memory.tsv, an NVML series
    (`epoch<TAB>phase<TAB>used_mib` rows) or repeated
    `nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`."""
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
