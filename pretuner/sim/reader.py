"""The emulated cards, read in-process: what `pretuner sim npu-smi` (Ascend profiles) or
`pretuner sim nvidia-smi` (CUDA profiles: `PRETUNER_SIM_PROFILE=h100-80`, ...) would print,
without a subprocess (a few small JSON files per sample)."""

from __future__ import annotations

from collections.abc import Mapping

from pretuner.devices.base import FASTEST_INTERVAL_S, DeviceMemory, Holder, Sample, keep
from pretuner.sim.memory import DEFAULT_PROFILE, PROFILES
from pretuner.sim.npusmi import TENANT_PID, read_cards


class EmulatedReader:
    name = "emulated"
    interval_s = FASTEST_INTERVAL_S

    def __init__(self, env: Mapping[str, str], devices: frozenset[int] | None = None) -> None:
        from pretuner.sim.state import state_dir  # the sim server module: only when emulating
        from pretuner.sim.v1.memory import CUDA_PROFILES

        wanted = env.get("PRETUNER_SIM_PROFILE") or DEFAULT_PROFILE
        self.cuda = CUDA_PROFILES.get(wanted)
        self.profile = PROFILES.get(wanted, PROFILES[DEFAULT_PROFILE])
        self.state = state_dir(dict(env))
        self.node = int(env.get("PRETUNER_SIM_NODE", "0") or 0)
        self.tenant_mib = int(env.get("PRETUNER_SIM_OCCUPIED_MIB", "0") or 0)
        self.devices = devices

    def sample(self) -> Sample | None:
        if self.cuda is not None:
            from pretuner.sim.v1.smi import read_gpus

            gpus = read_gpus(self.cuda, self.state, self.tenant_mib)
            total = self.cuda.nvml_total_mib
            return keep(tuple(DeviceMemory(g.index, g.used_mib, total) for g in gpus),
                        self.devices)
        cards = read_cards(self.profile, self.state, self.node, self.tenant_mib)
        total = self.profile.total_mib
        return keep(tuple(DeviceMemory(c.npu, c.hbm_used_mib, total) for c in cards),
                    self.devices)

    def holders(self) -> tuple[Holder, ...]:
        """The processes the emulated tool lists on the run's devices (the tenant of
        PRETUNER_SIM_OCCUPIED_MIB, live emulated servers)."""
        if self.cuda is not None:
            from pretuner.sim.v1.smi import read_gpus

            return tuple(Holder(g.index, pid, "python3", mib)
                         for g in read_gpus(self.cuda, self.state, self.tenant_mib)
                         for pid, mib in g.processes
                         if self.devices is None or g.index in self.devices)
        return tuple(Holder(c.npu, pid, "python3", mib)
                     for c in read_cards(self.profile, self.state, self.node, self.tenant_mib)
                     for pid, mib in ((TENANT_PID, c.tenant_mib), (c.pid, c.process_mib))
                     if pid is not None and mib
                     and (self.devices is None or c.npu in self.devices))
