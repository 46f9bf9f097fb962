"""The host's memory, where offloaded weights (`--cpu-offload-gb`) and swap space live.

A real host is read from /proc/meminfo (measured); the emulated card's host is the emulator's
(simulated, asked of the emulator plugin), since that is the host its server checks against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pretuner.devices.cpu import host_available_bytes, host_total_bytes


@dataclass(frozen=True, slots=True)
class HostMemory:
    available_bytes: int
    total_bytes: int
    provenance: str  # "measured" or "simulated"
    source: str  # where the figures come from

    def words(self) -> str:
        return (f"{self.available_bytes / 2**30:.2f} GiB available of "
                f"{self.total_bytes / 2**30:.2f} GiB ({self.provenance}, {self.source})")


def host_memory(device_kind: str, env: Mapping[str, str]) -> HostMemory | None:
    """The memory of the host the server runs on; None where it cannot be read."""
    if device_kind == "emulated":
        from pretuner.emulation import emulator

        return emulator().host_memory(env)
    available, total = host_available_bytes(), host_total_bytes()
    if available is None or total is None:
        return None
    return HostMemory(available, total, "measured", "/proc/meminfo")
