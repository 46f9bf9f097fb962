"""Ascend cards through `npu-smi info` (the parser lives in pretuner.devices.npu_table): the
sampling reader, and the card an r0.1 run sizes for, read once before it."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from pretuner.devices.base import CommandReader, DeviceMemory, Holding
from pretuner.devices.npu_table import NpuCard, decode_output, parse_npu_processes, parse_npu_smi
from pretuner.errors import BadInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CardInfo:
    """The card a run sizes for, before its first launch."""

    card_gib: int
    free_mib: int | None
    source: str  # "given", "npu-smi", "emulated npu-smi"
    # Processes npu-smi listed as holding memory on the card(s) before the run (other tenants).
    holders: tuple[Holding, ...] = ()


def npu_smi_text(argv: list[str], env: Mapping[str, str] | None = None,
                 timeout_s: float = 30) -> str:
    """What an `npu-smi info` command prints; "" when it is missing, fails or hangs."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.debug("npu-smi not usable: %s", err)
        return ""
    if proc.returncode != 0:
        return ""
    return decode_output(proc.stdout)  # non-UTF-8 bytes must not kill `pretuner run`


def detect_card(smi: list[str] | None, source: str, card_gib: int | None,
                env: Mapping[str, str]) -> CardInfo:
    """Card size and free memory from `smi` (an `npu-smi info` command; None: none) unless
    given; a --card that differs from the tool's is warned about, the tool's free memory kept."""
    if card_gib is not None and card_gib < 1:
        raise BadInputError(f"card size {card_gib} GiB is invalid", hint="e.g. --card 64")
    text = npu_smi_text(smi, env) if smi is not None else ""
    cards = parse_npu_smi(text)
    if cards:
        total = min(c.hbm_total_mib for c in cards)
        free = min(c.hbm_total_mib - c.hbm_used_mib for c in cards)
        measured = round(total / 1024)
        if card_gib is not None and card_gib != measured:
            log.warning("--card %d differs from the %d GiB npu-smi reports", card_gib, measured)
        # Only the processes on the cards this run sizes for: every chip npu-smi listed.
        return CardInfo(card_gib or measured, free, source, parse_npu_processes(text))
    if card_gib is None:
        raise BadInputError(
            "no card size: npu-smi is not available here", hint="pass --card (e.g. --card 64)"
        )
    return CardInfo(card_gib, None, "given")


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
