"""Ascend cards through `npu-smi info` (the parser lives in pretuner.launch.device)."""

from __future__ import annotations

import subprocess

from pretuner.devices.base import (
    FASTEST_INTERVAL_S,
    DeviceMemory,
    DeviceReadError,
    Sample,
    keep,
)
from pretuner.launch.device import NpuCard, decode_output, parse_npu_smi


def npu_memory(cards: tuple[NpuCard, ...]) -> tuple[DeviceMemory, ...]:
    """One entry per NPU: the chip of an A3 NPU that holds the most counts."""
    worst: dict[int, NpuCard] = {}
    for card in cards:
        if card.npu_id not in worst or card.hbm_used_mib > worst[card.npu_id].hbm_used_mib:
            worst[card.npu_id] = card
    return tuple(DeviceMemory(c.npu_id, c.hbm_used_mib, c.hbm_total_mib) for c in worst.values())


class NpuSmiReader:
    """`npu-smi info` run once per sample: as fast as the command answers."""

    name = "npu-smi"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, executable: str, devices: frozenset[int] | None = None,
                 timeout_s: float = 10.0) -> None:
        self.executable = executable
        self.devices = devices
        self.timeout_s = timeout_s

    def sample(self) -> Sample | None:
        try:
            done = subprocess.run([self.executable, "info"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise DeviceReadError(f"{self.executable} info: {err}") from err
        if done.returncode != 0:
            raise DeviceReadError(f"{self.executable} info exited with code {done.returncode}")
        return keep(npu_memory(parse_npu_smi(decode_output(done.stdout))), self.devices)
