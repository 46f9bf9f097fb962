"""A card another process holds memory on: told apart from a model that does not fit.

Pure. "Busy" is a verdict about the card, not the model: its free memory is well below what an
idle card of its size has free (the card less the driver's share) or npu-smi lists processes
holding memory on it, and what is left cannot hold the pre-run's pool. "Does not fit" is only
ever drawn from a measured launch on a card with its normal free memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from pretuner.devices.npu_table import NpuProcess
from pretuner.errors import CardBusyError

# The most an idle card's driver and firmware take, as a share of the card: 5 % on a 910B3
# 64 GB (3,379 MB), 7 % on a 910B4 32 GB, 10 % on the busiest driver build seen. Below the rest
# something else holds memory.
NORMAL_DRIVER_SHARE = 0.15


def normal_free_mib(card_gib: int) -> int:
    """The least an idle card of this size has free."""
    return int(card_gib * 1024 * (1 - NORMAL_DRIVER_SHARE))


def looks_busy(card_gib: int, free_mib: int, holders: Sequence[NpuProcess] = ()) -> bool:
    """Another process holds memory: npu-smi lists one, or far less is free than idle."""
    return bool(holders) or free_mib < normal_free_mib(card_gib)


def describe_holders(holders: Sequence[NpuProcess]) -> str:
    """'pid 4242 (python3, 40,000 MiB on NPU 0, 1)' per process, or '' when none is known."""
    by_pid: dict[int, list[NpuProcess]] = {}
    for p in holders:
        by_pid.setdefault(p.pid, []).append(p)
    parts = []
    for pid, rows in by_pid.items():
        npus = ", ".join(str(r.npu_id) for r in rows)
        parts.append(f"pid {pid} ({rows[0].name}, {max(r.memory_mib for r in rows):,} MiB on "
                     f"NPU {npus})")
    return "; ".join(parts)


def card_busy_error(
    *,
    card_gib: int,
    free_mib: int,
    source: str,
    need_mib: int,
    holders: Sequence[NpuProcess] = (),
    log_path: str | None = None,
    why: str | None = None,
) -> CardBusyError:
    """The error for a card too busy to measure anything on."""
    held = describe_holders(holders)
    who = f"; held by {held}" if held else ""
    where = f"; log {log_path}" if log_path else ""
    needs = f"the pre-run needs {need_mib:,} MiB"
    hint = (
        "stop those processes (an orphaned server of an earlier run?) or pick an idle card "
        "(ASCEND_RT_VISIBLE_DEVICES), then run again; nothing was concluded about the model"
        if held
        else "check `npu-smi info` and `ps -ef | grep python` for another server on the card, "
        "stop it or pick an idle card, then run again; nothing was concluded about the model"
    )
    return CardBusyError(
        f"the card is busy: {max(0, free_mib):,} MiB of its {card_gib * 1024:,} MiB free "
        f"({source}), "
        f"an idle {card_gib} GiB card has at least {normal_free_mib(card_gib):,} MiB free and "
        f"{why or needs}{who}{where}",
        hint=hint,
    )
