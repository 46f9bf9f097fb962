"""Which reader a run's devices have, if any."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from pretuner.devices.base import DeviceReader


def visible_devices(env: Mapping[str, str], variable: str, count: int) -> frozenset[int]:
    """The first `count` device indices the run uses: those listed in `variable`, else 0.."""
    listed = [int(x) for x in env.get(variable, "").split(",") if x.strip().isdigit()]
    return frozenset(listed[:count] if listed else range(count))


def select_reader(kind: str, env: Mapping[str, str], count: int = 1,
                  budget_mib: int | None = None,
                  visible_var: str | None = None) -> DeviceReader | None:
    """The reader for `kind`'s first `count` devices; None where nothing can read them (on
    "cpu": without a budget, `budget_mib`, imposed on the server's processes). The emulated
    card's are those its engine's `visible_var` lists (a Ray task's own GPUs), as a real one's."""
    if kind == "emulated":
        from pretuner.emulation import emulator

        listed = visible_devices(env, visible_var, count) if visible_var else range(count)
        return emulator().device_reader(env, frozenset(listed))
    if kind == "ascend":
        exe = shutil.which("npu-smi", path=env.get("PATH"))
        if exe is None:
            return None
        from pretuner.devices.npu_smi import NpuSmiReader

        return NpuSmiReader(exe, visible_devices(env, "ASCEND_RT_VISIBLE_DEVICES", count))
    if kind == "cuda":
        from pretuner.devices.nvidia import NvidiaSmiStreamReader, NvmlReader, load_nvml

        devices = visible_devices(env, "CUDA_VISIBLE_DEVICES", count)
        nvml = load_nvml()
        if nvml is not None:
            return NvmlReader(nvml, devices)
        exe = shutil.which("nvidia-smi", path=env.get("PATH"))
        if exe is None:
            return None
        # One nvidia-smi printing every 20 ms (-lms), not one started per sample.
        return NvidiaSmiStreamReader(exe, devices)
    if kind == "cpu" and budget_mib is not None and Path("/proc/self/status").is_file():
        from pretuner.devices.cpu import CpuBudgetReader

        return CpuBudgetReader(budget_mib)
    return None
