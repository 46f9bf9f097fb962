"""The host: its memory (/proc/meminfo), and the budgeted CPU "card": the largest data segment
(VmData, what the RLIMIT_DATA of `pretuner.launch.limit` checks) among the server's processes,
against that budget, so that the sampled peak is in the units of the limit that enforces it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pretuner.devices.base import DeviceMemory, DeviceReadError, Sample

CPU_INTERVAL_S = 0.1  # a /proc walk per sample: 2 cores are shared with the server
MEMINFO = Path("/proc/meminfo")


def meminfo_bytes(key: str, meminfo: Path = MEMINFO) -> int | None:
    """A /proc/meminfo figure of the host (MemAvailable, MemTotal), bytes (measured); None where
    it cannot be read."""
    try:
        with meminfo.open(encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB = KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


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
    """The memory of the host the server runs on (offloaded weights and swap space live
    there; the emulated card's is the emulator's); None where it cannot be read."""
    if device_kind == "emulated":
        from pretuner.emulation import emulator

        return emulator().host_memory(env)
    # MemTotal: what vLLM checks --swap-space against
    available, total = meminfo_bytes("MemAvailable"), meminfo_bytes("MemTotal")
    if available is None or total is None:
        return None
    return HostMemory(available, total, "measured", "/proc/meminfo")


def session_of(stat: str) -> int | None:
    """The session id in a /proc/PID/stat line (the comm field may hold spaces and ')')."""
    rest = stat[stat.rfind(")") + 2:].split()
    try:
        return int(rest[3])  # state, ppid, pgrp, session
    except (IndexError, ValueError):
        return None


def vm_data_kib(status: str) -> int | None:
    """VmData from a /proc/PID/status text, KiB; None for a kernel thread or a zombie."""
    for line in status.splitlines():
        if line.startswith("VmData:"):
            fields = line.split()
            return int(fields[1]) if len(fields) >= 2 and fields[1].isdigit() else None
    return None


class CpuBudgetReader:
    """The data segment of a launch's worst process, against the per-process budget."""

    name = "vmdata"
    interval_s = CPU_INTERVAL_S

    def __init__(self, budget_mib: int, proc: Path = Path("/proc")) -> None:
        if budget_mib <= 0:
            raise ValueError(f"the CPU memory budget must be positive, got {budget_mib} MiB")
        self.budget_mib = budget_mib
        self.proc = proc
        self.session: int | None = None

    def attach(self, pid: int) -> None:
        """Follow the processes of the session `pid` leads (a launch's server: a new session)."""
        self.session = pid

    def sample(self) -> Sample | None:
        if self.session is None:
            return None
        try:
            entries = os.listdir(self.proc)
        except OSError as err:
            raise DeviceReadError(f"cannot list {self.proc}: {err}") from err
        found = (self._data_kib(self.proc / entry) for entry in entries if entry.isdigit())
        worst_kib = max((kib for kib in found if kib is not None), default=None)
        if worst_kib is None:
            return None  # the server is gone (or not yet started)
        return Sample((DeviceMemory(0, worst_kib // 1024, self.budget_mib),))

    def _data_kib(self, folder: Path) -> int | None:
        try:
            if session_of((folder / "stat").read_text(encoding="utf-8", errors="replace")) \
                    != self.session:
                return None
            return vm_data_kib((folder / "status").read_text(encoding="utf-8",
                                                              errors="replace"))
        except OSError:  # the process exited between the listing and the read
            return None
