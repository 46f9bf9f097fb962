"""Where emulated servers publish the memory they hold, for the emulated device tools: files
written atomically, removed at the server's end, ignored once their writer died."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pretuner.files import write_atomic

STATE_DIR_ENV = "PRETUNER_SIM_STATE_DIR"
TENANT_PID = 4242  # the pid the device tools show for the other tenant (OCCUPIED_MIB)


def state_dir(env: Mapping[str, str]) -> Path:
    """Where servers publish per-card memory use (npu-smi and nvidia-smi read it)."""
    raw = env.get(STATE_DIR_ENV)
    if raw:
        return Path(raw)
    return Path(tempfile.gettempdir()) / f"pretuner-sim-{os.getuid()}"


def env_int(env: Mapping[str, str], name: str) -> int:
    return int(env.get(name, "0") or 0)


def alive(pid: int) -> bool:
    """A running process (an unreaped zombie holds no card memory)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def read_live(path: Path) -> dict[str, Any] | None:
    """A state file whose writer still runs; None when absent, unreadable or stale."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        live = isinstance(data, dict) and alive(int(data.get("pid", 0)))
    except (OSError, ValueError, TypeError):
        return None
    return data if live else None


class Published:
    """The state files one server holds: rewritten as its use changes, removed at its end
    (nothing is written after that, so a late step cannot leave a stale file behind)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self._lock = threading.Lock()
        self._gone = False

    def write(self, path: Path, data: dict[str, Any]) -> None:
        with self._lock:
            if self._gone:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(data), overwrite=True)
            if path not in self.paths:
                self.paths.append(path)

    def remove(self) -> None:
        with self._lock:
            self._gone = True
            for path in self.paths:
                path.unlink(missing_ok=True)
