"""The software an engine runs on (torch and its CUDA, torch-npu, MindSpore, vLLM, CANN), read
without importing the engine or torch: package metadata, torch's own version.py as text, the
CANN toolkit's install file. A proof holds for this stack only; serve.sh's guard checks it.

Standard library only, and runnable as `python -c SOURCE DIST...`: the engine's own venv, where
the registry asks it and where serve.sh's guard runs it, knows nothing of pretuner. Run so, it
prints `name=version` lines (and `engine=VERSION`, the first DIST installed, where vllm is).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

# The stack's name for each library -> its distribution; an engine's own is its version.
LIBRARIES = {"torch": "torch", "torch_npu": "torch-npu", "mindspore": "mindspore",
             "vllm": "vllm", "vllm_ascend": "vllm-ascend"}
# In words, for serve.sh's refusal and the report: "torch is 2.8.0 here, the proof ran 2.9.0".
LABELS = {"torch": "torch", "cuda": "torch's CUDA", "torch_npu": "torch-npu",
          "mindspore": "MindSpore", "vllm": "vLLM", "vllm_ascend": "vllm-ascend", "cann": "CANN"}
# CANN: `<toolkit>/<arch>-linux/ascend_toolkit_install.info`, a `version=8.3.RC1` line in it
# (what vllm-ascend's bug template cats); the toolkit is $ASCEND_TOOLKIT_HOME (set_env.sh).
CANN_HOME_VAR = "ASCEND_TOOLKIT_HOME"
CANN_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
# torch/version.py: `cuda = '12.8'` (older) or `cuda: Optional[str] = '13.0'`; None on CPU.
_TORCH_CUDA = re.compile(r"""^cuda\s*(?::[^=\n]*)?=\s*['"]([^'"\n]+)['"]""", re.MULTILINE)
_CANN_VERSION = re.compile(r"^version=(\S+)", re.MULTILINE)


def installed_version(*distributions: str) -> str | None:
    """The version of the first of these distributions that is installed."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _first_found(files: Iterable[Path], pattern: re.Pattern[str]) -> str | None:
    """The first group of `pattern` in the first of `files` that has it."""
    for path in files:
        try:
            found = pattern.search(path.read_text(errors="replace"))
        except OSError:
            continue
        if found is not None:
            return found.group(1)
    return None


def _torch_cuda() -> str | None:
    """The CUDA torch was built for, from torch/version.py's text (finding the package runs
    none of it)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    return _first_found((Path(folder) / "version.py" for folder in folders), _TORCH_CUDA)


def probe(engine_distributions: tuple[str, ...] | list[str],
          env: Mapping[str, str]) -> dict[str, str]:
    """What is installed beside the engine, by the stack's names; absent: not installed."""
    found = {name: installed_version(dist) for name, dist in LIBRARIES.items()
             if dist not in engine_distributions}
    cann = Path(env.get(CANN_HOME_VAR) or CANN_HOME).glob("*-linux/ascend_toolkit_install.info")
    found |= {"cuda": _torch_cuda(), "cann": _first_found(sorted(cann), _CANN_VERSION)}
    return {name: version for name, version in found.items() if version is not None}


def stack_words(stack: Mapping[str, str] | None) -> str:
    """"torch 2.9.0, torch's CUDA 12.8", as the scripts' header and report.md say it."""
    if stack is None:
        return "a software stack not recorded"
    said = ", ".join(f"{LABELS.get(k, k)} {v}" for k, v in stack.items())
    return said or "no torch, CANN or MindSpore"


if __name__ == "__main__":
    dists = sys.argv[1:]
    if importlib.util.find_spec("vllm") is not None:  # an engine of the vLLM family imports
        engine = installed_version(*dists)
        if engine is not None:
            print(f"engine={engine}")  # noqa: T201 (a script's answer)
    for name, version in probe(dists, os.environ).items():
        print(f"{name}={version}")  # noqa: T201
