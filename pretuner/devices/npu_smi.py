"""Ascend cards through `npu-smi info`: its table parsed into one record per chip and its
process table, the sampling reader, and the card an r0.1 run sizes for, read once before it."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pretuner.devices.base import CommandReader, DeviceMemory, DeviceReadError, Holder, run_tool
from pretuner.errors import BadInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NpuCard:
    """One chip of `npu-smi info` (910B: one chip per NPU; A3: two)."""

    npu_id: int
    chip: int
    name: str
    health: str
    hbm_used_mib: int
    hbm_total_mib: int


MAX_FIGURE_DIGITS = 10  # MiB: 10 digits is over 9 PiB, far beyond any card
# npu-smi says MB; the figures are MiB (a 64 GB card reports 65536).
_USAGE = re.compile(r"(\d+)\s*/\s*(\d+)")
# First cell of the name row: "0     910B3"; of the chip row: "0" (910B) or "0       1" (A3).
_NAME_CELL = re.compile(r"(\d+)\s+(\S.*)")
_CHIP_CELL = re.compile(r"(\d+)(?:\s+(\d+))?")  # and of a process row
_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")


def _cells(line: str) -> list[str]:
    stripped = line.strip()
    if not stripped.startswith("|"):
        return []
    return [cell.strip() for cell in stripped.strip("|").split("|")]


def parse_npu_smi(text: str) -> tuple[NpuCard, ...]:
    """Every chip in an `npu-smi info` table; text that is no such table gives ()."""
    cards: list[NpuCard] = []
    pending: tuple[int, str, str] | None = None  # (npu_id, name, health) of the row above
    for line in text.splitlines():
        lowered = line.lower()
        if "process id" in lowered or "process name" in lowered:
            break  # the process table that follows the cards looks like chip rows
        cells = _cells(line)
        if len(cells) < 3:
            if not line.strip().startswith("+"):
                pending = None
            continue
        name_match = _NAME_CELL.fullmatch(cells[0])
        chip_match = _CHIP_CELL.fullmatch(cells[0])
        if chip_match and _BUS_ID.fullmatch(cells[1]):
            usage = _USAGE.findall(cells[2])
            if pending is not None and usage and _sane(*usage[-1], chip_match.group(1)):
                # The last used/total pair of the row is HBM-Usage (Memory-Usage comes first).
                used, total = (int(x) for x in usage[-1])
                npu_id, name, health = pending
                cards.append(NpuCard(npu_id, int(chip_match.group(1)), name, health, used, total))
            pending = None
        elif (name_match and cells[1] and not _BUS_ID.fullmatch(cells[1])
              and _sane(name_match.group(1))):
            pending = (int(name_match.group(1)), name_match.group(2).strip(), cells[1])
        else:
            pending = None
    return tuple(cards)


@dataclass(frozen=True, slots=True)
class NpuProcess(Holder):
    """One row of the process table `npu-smi info` prints below the cards."""

    chip: int = 0

    @property
    def npu_id(self) -> int:
        return self.device


def parse_npu_processes(text: str) -> tuple[NpuProcess, ...]:
    """Every process holding memory in `npu-smi info`'s process table."""
    found: list[NpuProcess] = []
    in_table = False
    for line in text.splitlines():
        lowered = line.lower()
        if "process id" in lowered and "process name" in lowered:
            in_table = True
            continue
        cells = _cells(line) if in_table else []
        if len(cells) < 4:
            continue
        chip = _CHIP_CELL.fullmatch(cells[0])
        memory = re.match(r"\d+", cells[3])
        if chip is None or not cells[1].isdigit() or memory is None:
            continue
        found.append(NpuProcess(int(chip.group(1)), int(cells[1]), cells[2],
                                int(memory.group(0)), int(chip.group(2) or 0)))
    return tuple(found)


def _sane(*digits: str) -> bool:
    """Figures a device could print: a row with a longer one is garbage (and int() of 4,300
    digits raises), so it is skipped like any row that is not a card."""
    return all(len(d) <= MAX_FIGURE_DIGITS for d in digits)


def free_mib(card: NpuCard) -> int:
    """HBM not in use on the chip, MiB."""
    return card.hbm_total_mib - card.hbm_used_mib


@dataclass(frozen=True, slots=True)
class CardInfo:
    """The card a run sizes for, before its first launch."""

    card_gib: int
    free_mib: int | None
    source: str  # "given", "npu-smi", "emulated npu-smi"
    # Processes npu-smi listed as holding memory on the card(s) before the run (other tenants).
    holders: tuple[Holder, ...] = ()


def detect_card(smi: list[str] | None, source: str, card_gib: int | None,
                env: Mapping[str, str], timeout_s: float = 30) -> CardInfo:
    """Card size and free memory from `smi` (an `npu-smi info` command; None: none) unless
    given; a --card that differs from the tool's is warned about, the tool's free memory kept."""
    if card_gib is not None and card_gib < 1:
        raise BadInputError(f"card size {card_gib} GiB is invalid", hint="e.g. --card 64")
    text, why = "", "npu-smi is not available here"
    if smi is not None:
        try:
            text = run_tool(smi, timeout_s, env)
        except DeviceReadError as err:  # missing, failing or hung: said as it is
            log.debug("npu-smi not usable: %s", err)
            why = str(err)
    cards = parse_npu_smi(text)
    if cards:
        total = min(c.hbm_total_mib for c in cards)
        free = min(free_mib(c) for c in cards)
        measured = round(total / 1024)
        if card_gib is not None and card_gib != measured:
            log.warning("--card %d differs from the %d GiB npu-smi reports", card_gib, measured)
        # Only the processes on the cards this run sizes for: every chip npu-smi listed.
        return CardInfo(card_gib or measured, free, source, parse_npu_processes(text))
    if card_gib is None:
        raise BadInputError(f"no card size: {why}",
                            hint="pass --card (e.g. --card 64)")
    return CardInfo(card_gib, None, "given")


def npu_memory(text: str) -> tuple[DeviceMemory, ...]:
    """One entry per NPU of an `npu-smi info` table: the chip of an A3 NPU that holds the most
    counts."""
    worst: dict[int, NpuCard] = {}
    for card in parse_npu_smi(text):
        if card.npu_id not in worst or card.hbm_used_mib > worst[card.npu_id].hbm_used_mib:
            worst[card.npu_id] = card
    return tuple(DeviceMemory(c.npu_id, c.hbm_used_mib, c.hbm_total_mib) for c in worst.values())


class NpuSmiReader(CommandReader):
    """`npu-smi info` run once per sample: as fast as the command answers."""

    name = "npu-smi"
    args = ("info",)
    parse = staticmethod(npu_memory)

    def device_name(self) -> str | None:
        """The first device's chip name ("910B3") in `npu-smi info`'s name row."""
        first = min(self.devices or {0})
        cards = parse_npu_smi(run_tool([self.executable, *self.args], self.timeout_s))
        return next((c.name for c in cards if c.npu_id == first), None)
