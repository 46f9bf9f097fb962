"""Failures that are no memory verdict: a card another process holds memory on, a device that
refused to start for that reason, a server that crashed or answered an error without an
out-of-memory line.

"Busy" is a verdict about the card, not the model: its free memory is well below what an idle
card of its size has free (the card less the driver's share) or npu-smi lists processes
holding memory on it, and what is left cannot hold the pre-run's pool. "Does not fit" is only
ever drawn from a measured launch on a card with its normal free memory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pretuner.devices.base import DeviceReader, DeviceReadError, Holder, holders
from pretuner.engines.base import Engine
from pretuner.errors import CardBusyError, ServerFailedError
from pretuner.launch.process import read_tail

if TYPE_CHECKING:
    from pretuner.engines.outcome import LaunchOutcome

log = logging.getLogger(__name__)

# The most an idle card's driver and firmware take, as a share of the card: 5 % on a 910B3
# 64 GB (3,379 MB), 7 % on a 910B4 32 GB, 10 % on the busiest driver build seen. Below the rest
# something else holds memory.
NORMAL_DRIVER_SHARE = 0.15


def normal_free_mib(card_gib: int) -> int:
    """The least an idle card of this size has free."""
    return int(card_gib * 1024 * (1 - NORMAL_DRIVER_SHARE))


def looks_busy(card_gib: int, free_mib: int, holders: Sequence[Holder] = ()) -> bool:
    """Another process holds memory: npu-smi lists one, or far less is free than idle."""
    return bool(holders) or free_mib < normal_free_mib(card_gib)


def describe_holders(held: Sequence[Holder], device_word: str = "NPU") -> str:
    """'pid 4242 (python3, 40,000 MiB on NPU 0, 1)' per process, or '' when none is known."""
    by_pid: dict[int, list[Holder]] = {}
    for p in held:
        by_pid.setdefault(p.pid, []).append(p)
    parts = []
    for pid, rows in by_pid.items():
        devices = ", ".join(str(r.device) for r in rows)
        parts.append(f"pid {pid} ({rows[0].name}, {max(r.memory_mib for r in rows):,} MiB on "
                     f"{device_word} {devices})")
    return "; ".join(parts)


# What a device kind is called, how a user picks another, and the tool that lists its holders.
DEVICE_WORDS = {"cuda": ("GPU", "CUDA_VISIBLE_DEVICES", "nvidia-smi"),
                "ascend": ("NPU", "ASCEND_RT_VISIBLE_DEVICES", "npu-smi info")}


def card_busy_error(*, card_gib: int, free_mib: int, source: str, need_mib: int,
                    holders: Sequence[Holder] = (), log_path: str | None = None,
                    why: str | None = None, kind: str = "ascend",
                    total_mib: int | None = None) -> CardBusyError:
    """The error for a card too busy to measure anything on."""
    device_word, pick_hint, tool = DEVICE_WORDS[kind]
    held = describe_holders(holders, device_word)
    who = f"; held by {held}" if held else ""
    where = f"; log {log_path}" if log_path else ""
    needs = f"the pre-run needs {need_mib:,} MiB"
    hint = ("stop those processes (an orphaned server of an earlier run?) or pick an idle card "
            f"({pick_hint})" if held else f"check `{tool}` and `ps -ef | grep python` for another "
            "server on the card, stop it or pick an idle card")
    return CardBusyError(
        f"the card is busy: {max(0, free_mib):,} MiB of its "
        f"{total_mib or card_gib * 1024:,} MiB free ({source}), "
        f"an idle {card_gib} GiB card has at least {normal_free_mib(card_gib):,} MiB free and "
        f"{why or needs}{who}{where}",
        hint=hint + ", then run again; nothing was concluded about the model")


def refuse_busy_devices(engine: Engine, reader: DeviceReader | None, util: float) -> None:
    """Before the first launch of an engine that checks its share of the device at start-up
    (vLLM's V1 worker refuses to start when less than `util` x total is free): a device that
    cannot give that share because other processes hold its memory is busy (exit 8, with the
    MiB in use and the pids where the tool lists them), not a model that does not fit."""
    kind = engine.device
    source = f"{reader.name if reader is not None else 'no reader'}, before the run"
    sample = reader.sample() if reader is not None else None
    if sample is None or kind not in DEVICE_WORDS:
        return  # a budgeted CPU "card" holds nothing before its server starts
    device_word = DEVICE_WORDS[kind][0]
    short = [d for d in sample.devices if d.total_mib - d.used_mib < int(util * d.total_mib)]
    held = holders(reader) if short and reader is not None else ()  # one read, when it matters
    for d in short:
        free_mib = d.total_mib - d.used_mib
        need_mib = int(util * d.total_mib)
        card_gib = round(d.total_mib / 1024)
        if looks_busy(card_gib, free_mib, held):
            raise card_busy_error(
                card_gib=card_gib, free_mib=free_mib, source=source, need_mib=need_mib,
                holders=held, kind=kind, total_mib=d.total_mib,
                why=f"{d.used_mib:,} MiB are in use on {device_word} {d.device}; the engine "
                f"starts only with {need_mib:,} MiB free (--gpu-memory-utilization {util:g} of "
                f"{d.total_mib:,} MiB)")


def appeared(before: Sequence[Holder], now: Sequence[Holder]) -> tuple[Holder, ...]:
    """The processes holding device memory now that did not at the run's start: a second run, a
    server or a user that came during it (one that was there from the start is in the
    measurement the method derived from; one that came later is not)."""
    known = {(h.pid, h.device) for h in before}
    return tuple(h for h in now if (h.pid, h.device) not in known)


@dataclass(slots=True)
class Tenants:
    """The processes on the run's devices, looked at before and after every launch and at the
    end of its load, on every engine: one that was not there when this session's first launch
    started (a second run, a server, a user) voids what the run measured and proved (two
    emulated runs on one device both 'validated' 54.4 GiB, 60.0 alone): exit 8, its pids and
    MiB. Readers that cannot list processes (npu-smi, the CPU budget) give no verdict."""

    reader: DeviceReader | None
    at_start: tuple[Holder, ...] | None = None

    def check(self, when: str, ours: Callable[[int], bool] | None = None) -> None:
        """`ours`: whether a pid may be the launch's own server, while it runs."""
        if self.reader is None:
            return
        try:
            now = holders(self.reader)
        except DeviceReadError as err:  # no verdict on holders; the samples still stand
            log.warning("cannot list the device's processes %s: %s", when, err)
            return
        if self.at_start is None:
            self.at_start = now
            return
        new = [h for h in appeared(self.at_start, now) if ours is None or not ours(h.pid)]
        if new:
            raise CardBusyError(
                f"another process took device memory during the run ({when}): "
                f"{describe_holders(new, 'device')}; the launches measured a shared device, so "
                "the proof is void",
                hint="run on a device nothing else uses (a second pretuner run or server on "
                "it?), then run again; nothing was concluded about the model",
            )


class DeviceBusyRefusal(CardBusyError):
    """The device refused to start the server because another process holds its memory
    (MindSpore: "free memory size is less than half of total ... may be other processes
    occupying this card"). The tuner adds what it knows of the card and who holds it."""

    def __init__(self, free_mib: int, log_path: str) -> None:
        super().__init__(f"the device refused to start: only {free_mib:,} MiB free")
        self.free_mib = free_mib
        self.source = "the device's refusal at start"
        self.log_path = log_path


# MindSpore refuses to initialise a device with less than half of it free.
_OCCUPIED = re.compile(r"Device HBM free size:\s?(\d+) may be other processes occupying")


def crash_error(o: LaunchOutcome, what: str) -> ServerFailedError:
    """Requests failed and the log holds no out-of-memory line: the server crashed or answered
    an error, which says nothing about memory, so the run ends here."""
    code = o.server_exit_code
    killed = f"killed by signal {-code}, " if code is not None and code < 0 else ""
    how = (f"the server answered the {what} with an error" if code is None
           else f"the server crashed during the {what} ({killed}exit code {code})")
    tail = read_tail(Path(o.log_path), 15)
    return ServerFailedError(
        f"{how} without an out-of-memory line: {o.request_error or 'no error text'}; "
        "this is a server failure, not a memory verdict",
        hint=f"fix the server (or its --serve-cmd) and run again; log {o.log_path}"
        + (f"\nlast log lines:\n{tail}" if tail else ""),
        log_path=o.log_path,
    )


def device_busy(log_path: Path) -> DeviceBusyRefusal | None:
    match = _OCCUPIED.search(read_tail(log_path, 40))
    return DeviceBusyRefusal(int(match.group(1)) // 2**20, str(log_path)) if match else None
