"""The emulated cards, read in-process: what `pretuner sim npu-smi` (Ascend profiles) or
`pretuner sim nvidia-smi` (CUDA profiles) would print, without a subprocess."""

from __future__ import annotations

from collections.abc import Mapping

from pretuner.devices.base import FASTEST_INTERVAL_S, DeviceMemory, Holder, Sample, keep
from pretuner.sim.memory import DEFAULT_PROFILE, PROFILES
from pretuner.sim.npusmi import read_cards
from pretuner.sim.state import env_int, state_dir
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.sim.v1.smi import read_gpus

# (device, used MiB, (pid, MiB) of each process on it)
Use = tuple[int, int, tuple[tuple[int, int], ...]]


class EmulatedReader:
    name = "emulated"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, env: Mapping[str, str], devices: frozenset[int] | None = None) -> None:
        wanted = env.get("PRETUNER_SIM_PROFILE") or DEFAULT_PROFILE
        self.cuda = CUDA_PROFILES.get(wanted)
        self.profile = PROFILES.get(wanted, PROFILES[DEFAULT_PROFILE])
        self.state = state_dir(env)
        self.node = env_int(env, "PRETUNER_SIM_NODE")
        self.tenant_mib = env_int(env, "PRETUNER_SIM_OCCUPIED_MIB")
        self.devices = devices

    def _read(self) -> tuple[int, list[Use]]:
        """(total MiB, every device's use) as the emulated tool shows them now."""
        if self.cuda is not None:
            gpus = read_gpus(self.cuda, self.state, self.tenant_mib)
            return self.cuda.nvml_total_mib, [(g.index, g.used_mib, g.processes) for g in gpus]
        cards = read_cards(self.profile, self.state, self.node, self.tenant_mib)
        return self.profile.total_mib, [(c.npu, c.hbm_used_mib, c.processes) for c in cards]

    def sample(self) -> Sample | None:
        total, uses = self._read()
        return keep(tuple(DeviceMemory(i, used, total) for i, used, _ in uses), self.devices)

    def holders(self) -> tuple[Holder, ...]:
        """The processes the emulated tool lists on the run's devices."""
        return tuple(Holder(i, pid, "python3", mib) for i, _, procs in self._read()[1]
                     for pid, mib in procs if self.devices is None or i in self.devices)
