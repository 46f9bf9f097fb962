"""The emulated cards, read in-process: what `pretuner sim npu-smi` (Ascend profiles) or
`pretuner sim nvidia-smi` (CUDA profiles) would print, without a subprocess."""

from __future__ import annotations

from collections.abc import Mapping

from pretuner.devices.base import FASTEST_INTERVAL_S, DeviceMemory, Holder, Sample, keep
from pretuner.sim import npusmi
from pretuner.sim.memory import DEFAULT_PROFILE
from pretuner.sim.state import DeviceUse
from pretuner.sim.v1 import smi
from pretuner.sim.v1.memory import CUDA_PROFILES


class EmulatedReader:
    name = "emulated"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, env: Mapping[str, str], devices: frozenset[int] | None = None) -> None:
        self.env = dict(env)
        self.cuda = (env.get("PRETUNER_SIM_PROFILE") or DEFAULT_PROFILE) in CUDA_PROFILES
        self.devices = devices

    def _read(self) -> tuple[int, str, list[DeviceUse]]:
        """(total MiB, the card's name, every device's use) as the emulated tool shows them."""
        if self.cuda:
            cuda, gpus = smi.gpus(self.env)
            return cuda.nvml_total_mib, cuda.gpu_name, gpus
        profile, cards = npusmi.cards(self.env)
        return profile.total_mib, profile.chip_name, cards

    def sample(self) -> Sample | None:
        total, _, uses = self._read()
        return keep(tuple(DeviceMemory(u.index, u.used_mib, total) for u in uses), self.devices)

    def device_name(self) -> str | None:
        """The emulated card's name as its emulated tool prints it."""
        return self._read()[1]

    def holders(self) -> tuple[Holder, ...]:
        """The processes the emulated tool lists on the run's devices."""
        return tuple(Holder(u.index, pid, "python3", mib) for u in self._read()[2]
                     for pid, mib in u.processes if self.devices is None or u.index in self.devices)
