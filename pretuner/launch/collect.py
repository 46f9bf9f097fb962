"""Where a launch's logs are read: the pluggable collector behind `run_launch`.

The local collector follows `server.log` live and scans the launch folder after the stop
(one machine). `pretuner.cluster.session.RayCollector` does the same on every node of a Ray
cluster. Both hand `run_launch` the same things: live events, then one merged scan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretuner.devices.base import DeviceReader
from pretuner.launch.command import LaunchCommand
from pretuner.launch.sampler import MemorySampler, Phase
from pretuner.logscan import LogFollower, RankSummary, ScanResult, scan_paths
from pretuner.logscan.events import DeviceMemoryInit, Located, OomEvent


@dataclass(frozen=True, slots=True)
class CollectedScan:
    """Every rank's figures after the stop, from wherever they were written."""

    scan: ScanResult
    rank_peaks_mib: dict[str, int]
    init_free_mib: tuple[int, ...] = ()  # init lines the live follower could not see
    worst_node: str | None = None
    problem: str | None = None  # why a clean-looking scan cannot be trusted
    doc: dict[str, Any] = field(default_factory=dict)  # scan.json


def rank_name(r: RankSummary) -> str:
    return f"rank{r.rank}" if r.rank is not None else f"pid{r.pid}"


def rank_peaks(scan: ScanResult) -> dict[str, int]:
    return {rank_name(r): r.actual_peak_mib for r in scan.ranks if r.actual_peak_mib is not None}


class LocalCollector:
    """The launch folder on this machine: server.log live, every file after the stop (the Ray
    collector, a subclass, reads every node)."""

    def __init__(self, folder: Path, log_path: Path) -> None:
        self.folder = folder
        # Only what run_launch reads live: the dump lines are the scan's, after the stop.
        self.follower = LogFollower(log_path, keep=(OomEvent, DeviceMemoryInit))

    def prepare(self, cmd: LaunchCommand) -> LaunchCommand:
        """The launch's command with whatever this collector needs the ranks to do."""
        return cmd

    def sampler(self, reader: DeviceReader | None, status: Phase) -> MemorySampler:
        """What samples the devices during the launch (the Ray collector: every node's)."""
        return MemorySampler(reader, status=status)

    def poll(self, *, final: bool = False) -> list[Located]:
        """Events written since the last poll (never blocks for long)."""
        return self.follower.poll(final=final)

    def collect(self) -> CollectedScan:
        """Every rank's figures, after the server stopped."""
        scan = scan_paths([self.folder])
        return CollectedScan(scan, rank_peaks(scan), doc=scan.to_json())

    def where(self) -> str:
        """Where the logs are read, for the progress line."""
        return str(self.folder)


CollectorFactory = Callable[[Path, Path], LocalCollector]  # (launch folder, server.log)
