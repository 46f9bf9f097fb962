"""The DeviceReader protocol: used and total memory of the devices a run uses."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

FASTEST_INTERVAL_S = 0.02  # no reader is sampled more often than this


class DeviceReadError(Exception):
    """A reader that cannot read (its command failed, its library raised)."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's memory at one moment, MiB."""

    device: int
    used_mib: int
    total_mib: int


@dataclass(frozen=True, slots=True)
class Sample:
    """Every device a run uses, read at one moment."""

    devices: tuple[DeviceMemory, ...]

    @property
    def worst_used_mib(self) -> int:
        return max((d.used_mib for d in self.devices), default=0)


class DeviceReader(Protocol):
    name: str  # "emulated", "npu-smi", "nvml", "nvidia-smi"
    interval_s: float  # the shortest useful gap between two samples

    def sample(self) -> Sample | None:
        """The devices now; None when this read saw none of them. Raises DeviceReadError."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A process holding memory on one of the run's devices, as the device tool lists it."""

    device: int
    pid: int
    name: str
    memory_mib: int


def holders(reader: DeviceReader) -> tuple[Holder, ...]:
    """The processes holding memory on the reader's devices, where its tool lists them (NVML,
    the emulated card); nothing where it cannot tell."""
    hook = getattr(reader, "holders", None)
    return tuple(hook()) if callable(hook) else ()


def device_name(reader: DeviceReader | None) -> str | None:
    """The name of the reader's first device as its tool prints it ("NVIDIA H200", "910B3"),
    a proof's fingerprint; None where it cannot tell (a CPU budget, a tool that failed)."""
    hook = getattr(reader, "device_name", None)
    try:
        return hook() if callable(hook) else None
    except DeviceReadError:
        return None


def attach(reader: DeviceReader | None, pid: int) -> None:
    """Tell a reader that measures the server's own processes (the CPU budget) which launch
    to follow; a device reader (a card's total use) has no `attach` and needs none."""
    hook = getattr(reader, "attach", None)
    if callable(hook):
        hook(pid)


def keep(found: tuple[DeviceMemory, ...], devices: frozenset[int] | None) -> Sample | None:
    """The sample of the devices asked for (all when None); None when none of them is there."""
    chosen = tuple(d for d in found if devices is None or d.device in devices)
    return Sample(chosen) if chosen else None


class CommandReader:
    """A device tool run once per sample, as fast as it answers: the command's arguments and
    its parser are what a subclass gives."""

    name = "command"
    interval_s = FASTEST_INTERVAL_S
    args: tuple[str, ...] = ()
    parse: Callable[[str], tuple[DeviceMemory, ...]]  # the tool's output -> the devices

    def __init__(self, executable: str, devices: frozenset[int] | None = None,
                 timeout_s: float = 10.0) -> None:
        self.executable = executable
        self.devices = devices
        self.timeout_s = timeout_s

    def sample(self) -> Sample | None:
        return keep(self.parse(run_tool([self.executable, *self.args], self.timeout_s)),
                    self.devices)


def run_tool(argv: list[str], timeout_s: float, env: Mapping[str, str] | None = None) -> str:
    """What a device tool prints; DeviceReadError when it cannot run or fails."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, env=env, check=False)
    except FileNotFoundError:
        raise DeviceReadError(f"{argv[0]} is not available here") from None
    except subprocess.TimeoutExpired:  # a hung driver, not a missing tool: say which
        raise DeviceReadError(f"{shlex.join(argv)} timed out after {timeout_s:g} s") from None
    except OSError as err:
        raise DeviceReadError(f"{shlex.join(argv)}: {err.strerror or err}") from err
    if done.returncode != 0:
        raise DeviceReadError(f"{shlex.join(argv)} exited with code {done.returncode}")
    return decode_output(done.stdout)


def decode_output(raw: bytes | str) -> str:
    """A tool's output as text: bytes that are not UTF-8 become U+FFFD, never an error (they
    must not kill `pretuner run`)."""
    return raw if isinstance(raw, str) else raw.decode("utf-8", errors="replace")
