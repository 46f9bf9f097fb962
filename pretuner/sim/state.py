"""Where emulated servers publish the memory they hold, for the emulated device tools."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

STATE_DIR_ENV = "PRETUNER_SIM_STATE_DIR"


def state_dir(env: Mapping[str, str]) -> Path:
    """Where servers publish per-card memory use (npu-smi and nvidia-smi read it)."""
    raw = env.get(STATE_DIR_ENV)
    if raw:
        return Path(raw)
    return Path(tempfile.gettempdir()) / f"pretuner-sim-{os.getuid()}"
