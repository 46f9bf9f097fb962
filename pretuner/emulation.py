"""The emulated card as production sees it: a plugin found through the `pretuner.emulators`
entry point (production never imports `pretuner.sim`, ARCHITECTURE.md rule 3). An installation
without it says so when an emulated engine is asked for."""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, Protocol, cast

from pretuner.errors import BadInputError

if TYPE_CHECKING:
    from pretuner.devices.base import DeviceReader
    from pretuner.devices.cpu import HostMemory

GROUP = "pretuner.emulators"
# The emulated servers: vLLM-MindSpore r0.1 on an Ascend card, vLLM's V1 engine on a CUDA card,
# and the MindSpore reference server on CPU (real MindSpore, an emulated card around it).
Personality = Literal["r01", "v1", "mindspore-cpu"]


class Emulator(Protocol):
    def server_command(self, personality: Personality) -> list[str]:
        """The argv that starts an emulated server, before its flags."""
        ...

    def launch_env(self, personality: Personality, card_gib: int | None, seed: int,
                   exported: Mapping[str, str], *, weights_format: str | None = None,
                   nodes: int = 1) -> dict[str, str]:
        """The environment that gives a launch its emulated card (`card_gib`; None: the
        personality's default), its seed, and the emulator knobs the user `exported`; an
        unknown card size is refused (exit 2)."""
        ...

    def card_name(self, env: Mapping[str, str]) -> str | None:
        """The emulated CUDA card a V1 launch under `env` runs on, as the output names it
        ("emulated H200 141 GB"); None for another emulated card."""
        ...

    def batch_defaults(self, env: Mapping[str, str]) -> tuple[int, int]:
        """The emulated V1 server's (max-num-seqs, max-num-batched-tokens) on the card of
        `env` (a `launch_env`) when its flags give none."""
        ...

    def smi_command(self) -> list[str]:
        """The emulated `npu-smi info`, run under `launch_env`."""
        ...

    def device_reader(self, env: Mapping[str, str], devices: frozenset[int]) -> DeviceReader:
        ...

    def host_memory(self, env: Mapping[str, str]) -> HostMemory | None:
        ...


@functools.cache
def emulator() -> Emulator:
    """The installed emulator (the first of its entry-point group)."""
    for entry in importlib.metadata.entry_points(group=GROUP):
        return cast("Emulator", entry.load())
    raise BadInputError(f"no emulator is installed (nothing in the {GROUP!r} entry points)",
                        hint="reinstall pretuner (pip install -e .), or name a real engine")
