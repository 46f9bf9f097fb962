"""Where emulated servers publish the memory they hold, for the emulated device tools: one file
per server and device (`<kind>-node<k>-dev<i>-pid<pid>.json`, kind `npu` or `cuda`), written
atomically, removed at the server's end, ignored once its writer died."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pretuner.cluster.nodefs import node_local
from pretuner.files import write_atomic
from pretuner.procgroups import proc_available, start_ticks, stat_fields
from pretuner.units import MIB

STATE_DIR_ENV = "PRETUNER_SIM_STATE_DIR"
TENANT_PID = 4242  # the pid the device tools show for the other tenant (OCCUPIED_MIB)


def state_dir(env: Mapping[str, str]) -> Path:
    """Where servers publish per-card memory use (npu-smi and nvidia-smi read it), on this
    node's own disk (a Ray node of the emulated cluster: its `PRETUNER_SIM_NODE_ROOT`)."""
    raw = env.get(STATE_DIR_ENV)
    if raw:
        return node_local(raw, env)
    return Path(tempfile.gettempdir()) / f"pretuner-sim-{os.getuid()}"


def env_int(env: Mapping[str, str], name: str) -> int:
    return int(env.get(name, "0") or 0)


def alive(pid: int) -> bool:
    """A running process (an unreaped zombie holds no card memory)."""
    if pid <= 0:
        return False
    if proc_available():
        fields = stat_fields(pid)
        return fields is not None and fields[0] not in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass(frozen=True, slots=True)
class DeviceUse:
    """One emulated device as its tool shows it: memory used, and (pid, MiB) of each process."""

    index: int
    used_mib: int
    processes: tuple[tuple[int, int], ...] = ()


def _holders(state: Path, kind: str, node: int, device: int) -> list[tuple[int, int, int]]:
    """(writer pid, pid shown, MiB) of every live server on one device."""
    out = []
    for path in sorted(state.glob(f"{kind}-node{node}-dev{device}-pid*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            pid = int(data["pid"])
            # A server killed with SIGKILL leaves its file; a later process given the same pid
            # would hold its memory, so the pid must also have started when the writer did.
            if alive(pid) and data.get("start_ticks", start_ticks(pid)) == start_ticks(pid):
                out.append((pid, int(data["shown_pid"]), int(data["process_mib"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def read_devices(state: Path, kind: str, node: int, count: int, idle_mib: int,
                 tenant_mib: int = 0, total_mib: int | None = None) -> list[DeviceUse]:
    """Every device of the node: the idle reservation, the tenant and every live server."""
    devices = []
    for index in range(count):
        procs = [(shown, mib) for _, shown, mib in _holders(state, kind, node, index)]
        if tenant_mib:
            procs.insert(0, (TENANT_PID, tenant_mib))
        used = idle_mib + sum(m for _, m in procs)
        devices.append(DeviceUse(index, used if total_mib is None else min(used, total_mib),
                                 tuple(procs)))
    return devices


def others_bytes(state: Path, kind: str, places: Iterable[tuple[int, int]]) -> int:
    """The most other live servers hold on one of these (node, device) places."""
    own = os.getpid()
    return max((sum(m for pid, _, m in _holders(state, kind, node, device) if pid != own) * MIB
                for node, device in places), default=0)


class Published:
    """The state files one server holds: rewritten as its use changes, removed at its end
    (nothing is written after that, so a late step cannot leave a stale file behind)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self._lock = threading.Lock()
        self._gone = False

    def hold(self, state: Path, kind: str, node: int, device: int, process_mib: int,
             shown_pid: int | None = None) -> None:
        """This process now holds `process_mib` on the device (`shown_pid`: the rank's pid)."""
        pid = os.getpid()
        path = state / f"{kind}-node{node}-dev{device}-pid{pid}.json"
        data = {"pid": pid, "shown_pid": shown_pid or pid, "process_mib": process_mib,
                "start_ticks": start_ticks(pid)}
        with self._lock:
            if self._gone:
                return
            state.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(data), overwrite=True)
            if path not in self.paths:
                self.paths.append(path)

    def remove(self) -> None:
        with self._lock:
            self._gone = True
            for path in self.paths:
                path.unlink(missing_ok=True)


def compile_entry(state: Path, key: str) -> Path:
    """The emulated engine's torch.compile cache: one entry per configuration `key`, made by
    the boot that compiled it (a boot that dies before compiling leaves none); a later boot of
    the same key loads it."""
    return state / "compile-cache" / hashlib.sha256(key.encode()).hexdigest()[:10]


def remember_compiled(state: Path, key: str) -> None:
    entry = compile_entry(state, key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.touch()


def boot_noise_mib(state: Path, most_mib: int) -> int:
    """This boot's extra memory (PRETUNER_SIM_BOOT_NOISE_MIB): `most_mib` on every other boot
    that shares the state folder, 0 on the rest, so that two boots in a row differ by it."""
    if most_mib <= 0:
        return 0
    state.mkdir(parents=True, exist_ok=True)
    counter = state / "boots"
    try:
        boots = int(counter.read_text() or 0)
    except (OSError, ValueError):
        boots = 0
    write_atomic(counter, str(boots + 1), overwrite=True)
    return most_mib if boots % 2 else 0
