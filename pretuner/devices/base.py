"""The DeviceReader protocol: used and total memory of the devices a run uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

FASTEST_INTERVAL_S = 0.02  # no reader is sampled more often than this


class DeviceReadError(Exception):
    """A reader that cannot read (its command failed, its library raised)."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's memory at one moment, MiB."""

    device: int
    used_mib: int
    total_mib: int


@dataclass(frozen=True, slots=True)
class Sample:
    """Every device a run uses, read at one moment."""

    devices: tuple[DeviceMemory, ...]

    @property
    def worst_used_mib(self) -> int:
        return max((d.used_mib for d in self.devices), default=0)


class DeviceReader(Protocol):
    name: str  # "emulated", "npu-smi", "nvml", "nvidia-smi"
    interval_s: float  # the shortest useful gap between two samples

    def sample(self) -> Sample | None:
        """The devices now; None when this read saw none of them. Raises DeviceReadError."""
        ...


def keep(found: tuple[DeviceMemory, ...], devices: frozenset[int] | None) -> Sample | None:
    """The sample of the devices asked for (all when None); None when none of them is there."""
    chosen = tuple(d for d in found if devices is None or d.device in devices)
    return Sample(chosen) if chosen else None
