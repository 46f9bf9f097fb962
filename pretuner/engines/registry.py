"""Which engine a run drives: `--engine auto|NAME`, and why.

`auto` looks at what is installed and which devices exist: a V1 stack with its devices wins
(vLLM-MindSpore >= 0.3 or vllm-ascend with NPUs, vLLM with NVIDIA GPUs, the CPU build of
vLLM alone), then vLLM-MindSpore r0.1 with NPUs; with none of them the emulated r0.1 card
runs, and a warning says why. A named engine is the real one or exit 2 before any run folder:
a user who forgot to activate a venv must not get an emulated "VALIDATED". `--emulate` (or
`--engine sim`) asks for the emulated engine.

An engine may live in an interpreter of its own (`engine_python`: --engine-python, else
PRETUNER_ENGINE_PYTHON); `auto` counts vLLM on CPU only where pretuner's own Python imports it
or a variable names one: the install script's `.venv-vllm` beside a checkout must not turn
every run started there into a real-engine run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pretuner.engines import stack as stack_probe
from pretuner.engines.base import Engine, Family
from pretuner.engines.mindspore_r01 import MINDSPORE_CPU, NAMES, R01, SIM, R01Engine, version_tuple
from pretuner.engines.stack import installed_version
from pretuner.engines.vllm_v1 import (
    ENGINE_PYTHON_VAR,
    INSTALL_HINT,
    ROWS,
    V1Engine,
    V1Row,
    engine_python,
)
from pretuner.errors import BadInputError

ENGINES = ("auto", *NAMES, *ROWS)
STACK_PROBE = Path(stack_probe.__file__).read_text()  # run by the engine's own Python
# `--backend` (one release more, then gone): the r0.1 method's old name for its server.
BACKEND_ALIASES = {"vllm-mindspore": R01, SIM: SIM, MINDSPORE_CPU: MINDSPORE_CPU}


class EngineMissing(BadInputError):
    """A named engine, or its devices, is not here."""


HOW_TO_POINT = (f"point --engine-python (or {ENGINE_PYTHON_VAR}) at the Python of the venv or "
                "conda env that has it, give the command that starts it with --serve-cmd (e.g. "
                "'docker run --gpus all --ipc=host --network=host vllm/vllm-openai'), or add "
                "--emulate for the emulated engine")


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str
    family: Family
    simulated: bool
    version: str | None
    reason: str
    python: str | None = None  # the interpreter of an engine that lives in its own venv
    # torch/CUDA/CANN/MindSpore... beside the engine (pretuner.engines.stack); None: not
    # recorded (the emulated engine, a --serve-cmd's container)
    stack: dict[str, str] | None = None

    def r01(self) -> R01Engine:
        """The r0.1 engine this choice names (the family's only class of engine)."""
        return R01Engine(self.name, self.simulated, self.version, self.reason)


def engine_class(name: str | None) -> type[Engine]:
    """The engine class of a registry name; None (an r0.1 run's layout options) is r0.1's."""
    return V1Engine if name in ROWS else R01Engine


def _located(row: V1Row, python: str | None,
             auto: bool = False) -> tuple[str | None, str, dict[str, str]] | None:
    """(interpreter, version, stack) of `row`'s engine: in the Python `engine_python` names,
    which must import vllm, else (interpreter None) in pretuner's own; None where it is not
    found. For `auto`, an engine in its own venv counts only where a variable or pretuner's
    Python names it."""
    named = row.named_python(os.environ, python)
    if auto and row.python_var is not None and not named:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return None
    found = engine_python(row, os.environ, python)
    if found is not None:  # serve.sh names it: absolute, and a bare `python3` looked up on PATH
        found = os.path.abspath(shutil.which(found) or found)
    if found is None or found == sys.executable:
        version = installed_version(*row.distributions)
        stack = stack_probe.probe(row.distributions, os.environ)
    else:  # the version and the stack as that interpreter (its own venv) sees them
        try:
            done = subprocess.run([found, "-c", STACK_PROBE, *row.distributions],
                                  capture_output=True, timeout=60, check=False,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        said = dict(line.partition("=")[::2] for line in
                    done.stdout.decode(errors="replace").splitlines() if "=" in line)
        version = said.pop("engine", None) if done.returncode == 0 else None
        stack = said
    return (found, version, stack) if version is not None else None


def _no_devices(kind: str) -> str | None:
    """Why the machine shows no device of this kind (its management tool lists none); None
    where it does."""
    if kind == "cpu":
        return None
    tool = {"cuda": ("nvidia-smi", "-L"), "ascend": ("npu-smi", "info")}[kind]
    exe = shutil.which(tool[0])
    if exe is None:
        return f"{tool[0]} is not on PATH"
    try:
        done = subprocess.run([exe, tool[1]], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`{' '.join(tool)}` failed ({err})"
    if done.returncode == 0 and done.stdout.strip():
        return None
    return f"`{' '.join(tool)}` lists no {kind} device"


def choose_engine(requested: str, *, emulate: bool = False, python: str | None = None,
                  wrapped: bool = False, launch: bool = True) -> EngineChoice:
    """The engine for `--engine requested`; a bad name lists the choices. A named engine is the
    real one (run by --serve-cmd when `wrapped`) or a refusal (exit 2); `emulate` (or `sim`)
    asks for the emulated one; only `auto` falls back to the emulated card. `plan` (`launch`
    False) starts nothing: a missing engine is emulated there."""
    if requested not in ENGINES:
        raise BadInputError(f"unknown engine {requested!r}",
                            hint=f"choose one of: {', '.join(ENGINES)}")
    if emulate or requested == SIM:
        if python is not None:
            raise BadInputError("--emulate runs the emulated engine, not the one in "
                                f"--engine-python {python}", hint="drop one of them")
        return _emulated(requested, f"--engine {requested} --emulate")
    if requested == "auto":
        return _auto(python)
    try:
        return _named(requested, python, wrapped)
    except EngineMissing:
        if launch or requested in (MINDSPORE_CPU, "vllm-cpu"):
            raise
        return _emulated(requested, f"--engine {requested} (plan: as emulated)")


def _named(requested: str, python: str | None, wrapped: bool) -> EngineChoice:
    if requested in NAMES:
        if python is not None:
            raise BadInputError(f"--engine-python is for V1 engines, not {requested}",
                                hint="give the r0.1 server's own command with --serve-cmd")
        return _r01(requested, wrapped)
    row = ROWS[requested]
    dist = row.distributions[0]
    if wrapped:  # the user's command starts it, wherever it is (a container's is not this
        # machine's): its version only from a Python the user named as the engine's
        named = _located(row, python) if row.named_python(os.environ, python) else None
        return EngineChoice(row.name, Family.V1, False, named[1] if named else None,
                            f"--engine {requested}: started by --serve-cmd")
    found = _located(row, python)
    if found is None:
        where = engine_python(row, os.environ, python) or f"pretuner's Python ({sys.executable})"
        raise EngineMissing(f"--engine {requested}: {dist} is not installed in {where}",
                            hint=INSTALL_HINT if row.python_var else HOW_TO_POINT)
    interpreter, version, stack = found
    why = _no_devices(row.device)
    if why is not None:
        raise EngineMissing(f"--engine {requested}: {dist} {version} is installed but {why}",
                            hint="run pretuner where the devices are, or add --emulate for "
                            "the emulated engine")
    here = f" ({interpreter})" if interpreter else ""
    return EngineChoice(row.name, Family.V1, False, version,
                        f"--engine {requested}: {dist} {version}{here}", python=interpreter,
                        stack=stack)


def _emulated(requested: str, asked: str) -> EngineChoice:
    """The emulated engine `requested` stands for: the r0.1 card, or the emulated vLLM server."""
    if requested in (MINDSPORE_CPU, "vllm-cpu"):
        raise BadInputError(f"--engine {requested} runs on this CPU and has no emulated twin",
                            hint="--engine sim (the emulated r0.1 card) or --engine vllm "
                            "--emulate (the emulated vLLM server)")
    if requested in ROWS:
        return EngineChoice(requested, Family.V1, True, None,
                            f"{asked}: the emulated vLLM server (simulated figures)")
    name = SIM if requested == SIM else R01
    return EngineChoice(name, Family.R01, True, None,
                        f"{asked}: the r0.1 method on the emulated card (simulated figures)")


def _auto(python: str | None) -> EngineChoice:
    ms = installed_version(*ROWS["vllm-mindspore"].distributions)
    npu = _no_devices("ascend")
    if ms is not None and npu is None:
        stack = stack_probe.probe(ROWS["vllm-mindspore"].distributions, os.environ)
        if version_tuple(ms) >= (0, 3):
            return EngineChoice("vllm-mindspore", Family.V1, False, ms,
                                f"auto: vllm-mindspore {ms} (a V1 engine) and NPUs",
                                stack=stack)
        return EngineChoice(R01, Family.R01, False, ms, f"auto: vllm-mindspore {ms} and NPUs",
                            stack=stack)
    for name in ("vllm-ascend", "vllm"):
        row = ROWS[name]
        found = _located(row, python)
        if found is not None and _no_devices(row.device) is None:
            return EngineChoice(name, Family.V1, False, found[1],
                                f"auto: {row.distributions[0]} {found[1]} and {row.device} "
                                "devices", python=found[0], stack=found[2])
    cpu = _located(ROWS["vllm-cpu"], python, auto=True)
    if cpu is not None:
        return EngineChoice("vllm-cpu", Family.V1, False, cpu[1],
                            f"auto: vllm-cpu {cpu[1]} ({cpu[0]}) is the only engine installed",
                            python=cpu[0], stack=cpu[2])
    why = "vLLM-MindSpore is not installed" if ms is None else npu
    return EngineChoice(R01, Family.R01, True, None,
                        f"auto: no engine with its devices here ({why}, and no vLLM with GPUs): "
                        "the r0.1 method runs on the EMULATED card, its figures simulated; "
                        "for the real engine name it (--engine vllm|vllm-ascend|...) and "
                        "point --engine-python or --serve-cmd at it")


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


def _r01(requested: str, wrapped: bool) -> EngineChoice:
    """An r0.1 engine by name: the real one where npu-smi shows NPUs or --serve-cmd starts it
    (its command is checked before the run); MindSpore on CPU only where MindSpore is."""
    if requested == MINDSPORE_CPU:
        ms = installed_version("mindspore")
        if ms is None:
            raise EngineMissing(
                "--engine mindspore-cpu needs MindSpore, which is not installed",
                hint="pip install 'pretuner[mindspore]' (MindSpore runs on CPU), or --engine sim",
            )
        # The reference server speaks r0.1: no vLLM-MindSpore version to adapt to.
        return EngineChoice(MINDSPORE_CPU, Family.R01, False, None, f"MindSpore {ms} on CPU",
                            stack=stack_probe.probe((), os.environ))
    if wrapped:  # the user's command starts it, wherever it is (a container's is not this
        # machine's); the run proved r0.1's variables, which the scripts then keep
        return EngineChoice(R01, Family.R01, False, None, f"--engine {R01}: started by --serve-cmd")
    why = _no_devices("ascend")
    if why is not None:
        raise EngineMissing(f"--engine {R01}: {why}",
                            hint="run pretuner where the NPUs are, give the server's command "
                            "with --serve-cmd, or add --emulate (--engine sim) for the "
                            "emulated card")
    version = installed_version(*ROWS["vllm-mindspore"].distributions)
    here = f"vllm-mindspore {version}" if version else "vllm-mindspore not importable here"
    return EngineChoice(R01, Family.R01, False, version, f"--engine {R01}: NPUs ({here})",
                        stack=stack_probe.probe(ROWS["vllm-mindspore"].distributions, os.environ))
