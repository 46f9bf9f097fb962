"""The card on a CPU: MindSpore's pool sized like `max_device_memory`, capped by an OS limit.

MindSpore ignores `max_device_memory` on CPU, so the server sizes the pool's first block as
TOTAL x util and caps its address space (RLIMIT_AS) at baseline + pool + HOST_ALLOWANCE. The
allowance is below the pool's 1 GiB growth unit, so growing past the cap fails in MindSpore's
own allocator, with its `Memory not enough` and pool dump, as on a card."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import threading
from pathlib import Path

from pretuner.units import MIB

HOST_ALLOWANCE_BYTES = 512 * MIB  # below the pool's 1 GiB growth unit, on purpose
_M_ARENA_MAX = -8  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 * MIB  # fixed: freed large buffers are unmapped, not kept
THREAD_STACK_BYTES = 1 << 20


def vm_size_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's reserved address space (VmSize)."""
    for line in status.read_text(encoding="ascii", errors="replace").splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise OSError("VmSize missing from /proc/self/status")


def keep_reservations_small() -> None:
    """Fewer malloc arenas, freed buffers unmapped, smaller thread stacks: less address space
    outside the pool, and what there is reflects live buffers."""
    threading.stack_size(THREAD_STACK_BYTES)
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_ARENA_MAX, 2)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        return


def limit_address_space(baseline_bytes: int, pool_bytes: int) -> int:
    """Cap RLIMIT_AS at baseline + pool + host allowance; returns the limit in bytes."""
    limit = baseline_bytes + pool_bytes + HOST_ALLOWANCE_BYTES
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit
