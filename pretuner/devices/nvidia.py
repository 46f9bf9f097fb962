"""NVIDIA cards: NVML through pynvml (the optional `nvidia-ml-py`), else `nvidia-smi`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretuner.devices.base import (
    FASTEST_INTERVAL_S,
    CommandReader,
    DeviceMemory,
    DeviceReadError,
    Holder,
    Sample,
)
from pretuner.units import MIB

QUERY = ("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")


def parse_nvidia_smi_csv(text: str) -> tuple[DeviceMemory, ...]:
    """`nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`:
    one `0, 1234, 81559` row per GPU (MiB); rows that are not that ("[N/A]") are skipped."""
    found = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 3 and all(c.isdigit() and len(c) <= 10 for c in cells):
            found.append(DeviceMemory(int(cells[0]), int(cells[1]), int(cells[2])))
    return tuple(found)


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One row of an NVML series file: `epoch_s<TAB>[run:]phase<TAB>used_mib`."""

    epoch_s: float
    run: str | None
    phase: str
    used_mib: int


def parse_nvml_series(text: str) -> tuple[SeriesPoint, ...]:
    """An NVML series (tab-separated epoch seconds, `run:phase` or `phase`, used MiB);
    malformed rows are skipped."""
    points = []
    for line in text.splitlines():
        cells = line.strip().split("\t")
        if len(cells) != 3 or not cells[2].isdigit() or len(cells[2]) > 10:
            continue
        try:
            epoch = float(cells[0])
        except ValueError:
            continue
        run, _, phase = cells[1].rpartition(":")
        points.append(SeriesPoint(epoch, run or None, phase, int(cells[2])))
    return tuple(points)


def series_peaks(points: tuple[SeriesPoint, ...]) -> dict[str, int]:
    """The peak used MiB of each phase of a series."""
    peaks: dict[str, int] = {}
    for p in points:
        peaks[p.phase] = max(peaks.get(p.phase, 0), p.used_mib)
    return peaks


class NvidiaSmiReader(CommandReader):
    """`nvidia-smi --query-gpu=…` run once per sample: as fast as the command answers."""

    name = "nvidia-smi"
    args = QUERY

    def parse(self, text: str) -> tuple[DeviceMemory, ...]:
        return parse_nvidia_smi_csv(text)


def load_nvml() -> Any | None:
    """The pynvml module, initialised; None when it is not installed or finds no driver."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_*: no driver, no GPU
        return None
    return pynvml


class NvmlReader:
    """NVML in-process: cheap enough for every 20 ms."""

    name = "nvml"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, nvml: Any, devices: frozenset[int] | None = None) -> None:
        self.nvml = nvml
        count = int(nvml.nvmlDeviceGetCount())
        wanted = range(count) if devices is None else sorted(d for d in devices if d < count)
        self.handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in wanted]

    def sample(self) -> Sample | None:
        found = []
        try:
            for index, handle in self.handles:
                info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                found.append(DeviceMemory(index, int(info.used) // MIB, int(info.total) // MIB))
        except Exception as err:  # NVMLError_*: the library's own hierarchy
            raise DeviceReadError(f"NVML: {err}") from err
        return Sample(tuple(found)) if found else None

    def holders(self) -> tuple[Holder, ...]:
        found = []
        try:
            for index, handle in self.handles:
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = int(proc.usedGpuMemory or 0) // MIB
                    found.append(Holder(index, int(proc.pid), _process_name(proc.pid), used))
        except Exception as err:  # NVMLError_*: no verdict on holders, the sample still stands
            raise DeviceReadError(f"NVML: {err}") from err
        return tuple(found)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip() or "?"
    except OSError:
        return "?"  # another container's process: NVML sees it, /proc does not
