"""Ascend cards through `npu-smi info` (the parser lives in pretuner.devices.npu_table)."""

from __future__ import annotations

from pretuner.devices.base import CommandReader, DeviceMemory
from pretuner.devices.npu_table import NpuCard, decode_output, parse_npu_smi


def npu_memory(cards: tuple[NpuCard, ...]) -> tuple[DeviceMemory, ...]:
    """One entry per NPU: the chip of an A3 NPU that holds the most counts."""
    worst: dict[int, NpuCard] = {}
    for card in cards:
        if card.npu_id not in worst or card.hbm_used_mib > worst[card.npu_id].hbm_used_mib:
            worst[card.npu_id] = card
    return tuple(DeviceMemory(c.npu_id, c.hbm_used_mib, c.hbm_total_mib) for c in worst.values())


class NpuSmiReader(CommandReader):
    """`npu-smi info` run once per sample: as fast as the command answers."""

    name = "npu-smi"
    args = ("info",)

    def parse(self, stdout: bytes) -> tuple[DeviceMemory, ...]:
        return npu_memory(parse_npu_smi(decode_output(stdout)))
