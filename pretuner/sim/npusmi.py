"""`npu-smi info` for the emulated cards, in the real 910B layout (two rows per NPU).

A card a live emulated server uses shows the driver reservation, the CANN share and the whole
MindSpore pool (`enable_vmm:False`: MindSpore takes `max_device_memory` at init), as published
in the state dir (`pretuner.sim.state`); `PRETUNER_SIM_NODE` selects the emulated node."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pretuner.files import write_atomic
from pretuner.sim.memory import DEFAULT_PROFILE, PROFILES, CardProfile
from pretuner.sim.state import DeviceUse, env_int, read_devices, state_dir

VERSION = "23.0.6"
_BUS = ("C1", "01", "41", "81", "C2", "02", "42", "82")
_BORDER = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 52 + "+"
_DOUBLE = "+" + "=" * 27 + "+" + "=" * 15 + "+" + "=" * 52 + "+"


def _usage(used: int, total: int) -> str:
    return f"{used:<5}/ {total}"  # a 5-digit figure touches the slash, as on a real card


def cards(env: Mapping[str, str]) -> tuple[CardProfile, list[DeviceUse]]:
    """The card profile (`PRETUNER_SIM_PROFILE`) and the cards of `PRETUNER_SIM_NODE` now."""
    p = PROFILES.get(env.get("PRETUNER_SIM_PROFILE") or DEFAULT_PROFILE, PROFILES[DEFAULT_PROFILE])
    return p, read_devices(state_dir(env), "npu", env_int(env, "PRETUNER_SIM_NODE"),
                           p.cards_per_node, p.driver_reserved_mib,
                           env_int(env, "PRETUNER_SIM_OCCUPIED_MIB"))


def render(profile: CardProfile, cards: Sequence[DeviceUse]) -> str:
    """The full `npu-smi info` text."""
    width = len(_BORDER) - 2
    lines = [
        "+" + "-" * width + "+",
        "| " + f"npu-smi {VERSION}".ljust(33) + f"Version: {VERSION}".ljust(width - 34) + "|",
        _BORDER,
        "| NPU   Name                | Health        | Power(W)    Temp(C)           "
        "Hugepages-Usage(page)|",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  "
        "HBM-Usage(MB)        |",
        _DOUBLE,
    ]
    for card in cards:
        bus = f"0000:{_BUS[card.index % len(_BUS)]}:00.0"
        busy = bool(card.processes)
        power = f"{profile.power_w + (95.0 if busy else 0.0):.1f}"
        lines.append(f"| {card.index:<6}{profile.chip_name:<20}| {'OK':<14}| {power:<12}"
                     f"{profile.temp_c + (6 if busy else 0):<18}{_usage(0, 0):<21}|")
        lines.append(f"| {0:<26}| {bus:<14}| {0:<12}{_usage(0, 0):<18}"
                     f"{_usage(card.used_mib, profile.total_mib):<21}|")
        lines.append(_DOUBLE)
    lines += [
        _BORDER,
        "| NPU     Chip              | Process id    | Process name             | Process "
        "memory(MB)      |",
        _DOUBLE,
    ]
    for card in cards:
        if not card.processes:
            lines.append("| " + f"No running processes found in NPU {card.index}".ljust(width - 1)
                         + "|")
        for pid, mib in card.processes:
            lines.append(f"| {card.index:<8}{0:<18}| {pid:<14}| {'python3':<25}| {mib:<24}|")
        lines.append(_DOUBLE)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        sys.stdout.write("usage: npu-smi info   (emulated by pretuner; figures are simulated)\n")
        return 0
    if args[:1] not in ([], ["info"]):
        sys.stderr.write(f"Error: unsupported command {' '.join(args)!r} (the emulated npu-smi "
                         "knows `info`)\n")
        return 1
    sys.stdout.write(render(*cards(os.environ)))
    return 0


SHIM = """#!/bin/sh
# npu-smi shim written by `pretuner sim install-shim`: the emulated card (simulated figures).
exec {python} -m pretuner.sim npu-smi "$@"
"""


def write_shim(directory: Path, python: str) -> Path:
    """Write an executable `npu-smi` in `directory` that runs the emulated one."""
    import shlex

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "npu-smi"
    return write_atomic(path, SHIM.format(python=shlex.quote(python)), executable=True,
                        overwrite=True)
