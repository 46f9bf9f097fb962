"""Where the engine lives (issue 27, item 1): a named engine is the real one, found in pretuner's
Python, in the interpreter --engine-python names, or started by --serve-cmd; one not found is
exit 2 before any run folder; only `auto` falls back to the emulated card, and `--emulate` asks
for it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pretuner.engines import registry
from pretuner.engines.registry import EngineMissing, choose_engine
from pretuner.errors import BadInputError
from tests.helpers import R01_QWEN_64, FinishedRun, cli_env, invoke


def other_venv(root: Path, dist: str = "vllm", version: str = "0.24.0") -> Path:
    """A venv-like interpreter that is not pretuner's: a `python` that runs the real one with a
    fake `vllm` package (distribution `dist`) on its path, and the `vllm` script beside it."""
    site, bin_dir = root / "site", root / "bin"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    meta = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    (bin_dir / "vllm").write_text("#!/bin/sh\nexit 3\n")
    for script in (python, bin_dir / "vllm"):
        script.chmod(0o755)
    return python


def gpu_host(root: Path) -> dict[str, str]:
    """The environment of a machine whose nvidia-smi lists GPUs (the emulated tool)."""
    tool = root / "tools" / "nvidia-smi"
    tool.parent.mkdir(parents=True)
    tool.write_text(f"#!/bin/sh\nexec {sys.executable} -m pretuner.sim nvidia-smi \"$@\"\n")
    tool.chmod(0o755)
    return cli_env(PATH=f"{tool.parent}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def nothing_here(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A machine with no engine in pretuner's Python and no variable naming another."""
    for var in ("PRETUNER_ENGINE_PYTHON", "PRETUNER_VLLM_PYTHON"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(registry, "installed_version", lambda *names: None)
    monkeypatch.setattr(registry, "_no_devices", lambda kind: None if kind == "cpu" else "none")
    return monkeypatch


# (engine, installed here, devices show, --emulate, --serve-cmd) -> simulated, or the refusal
DECISIONS = [
    ("vllm", True, True, False, False, False),
    ("vllm", True, False, False, False, "is installed but none"),
    ("vllm", False, True, False, False, "vllm is not installed"),
    ("vllm", False, False, False, True, False),  # the wrapper runs it, wherever it is
    ("vllm", False, False, True, False, True),
    ("vllm", False, False, True, True, True),  # the wrapper starts the emulated server
    ("vllm-ascend", False, True, False, False, "vllm-ascend is not installed"),
    ("vllm-mindspore-r01", True, False, False, False, "none"),
    ("vllm-mindspore-r01", False, True, False, False, False),
    ("vllm-mindspore-r01", False, False, False, True, False),
    ("vllm-mindspore-r01", False, False, True, False, True),
    ("sim", False, False, False, False, True),
    ("vllm-cpu", False, True, True, False, "no emulated twin"),
    ("mindspore-cpu", False, True, True, False, "no emulated twin"),
]


@pytest.mark.parametrize(("engine", "installed", "devices", "emulate", "wrapped", "then"),
                         DECISIONS)
def test_a_named_engine_is_real_or_refused(nothing_here: pytest.MonkeyPatch, engine: str,
                                           installed: bool, devices: bool, emulate: bool,
                                           wrapped: bool, then: bool | str) -> None:
    nothing_here.setattr(registry, "installed_version",
                         lambda *names: "0.24.0" if installed else None)
    nothing_here.setattr(registry, "_no_devices",
                         lambda kind: None if devices or kind == "cpu" else "none")
    if isinstance(then, str):
        with pytest.raises(BadInputError, match=then):
            choose_engine(engine, emulate=emulate, wrapped=wrapped)
        return
    choice = choose_engine(engine, emulate=emulate, wrapped=wrapped)
    assert choice.simulated is then
    assert choice.name == ("sim" if engine == "sim" else engine)


def test_behind_a_serve_cmd_the_version_is_the_named_pythons_or_unknown(
        nothing_here: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rule: a --serve-cmd (a container, srun) starts an engine pretuner's own Python may not
    have: the run records no version from there, only from a Python the user named."""
    nothing_here.setattr(registry, "installed_version", lambda *names: "0.11.0")  # here
    assert choose_engine("vllm", wrapped=True).version is None
    named = other_venv(tmp_path / "engine", version="0.24.0")
    assert choose_engine("vllm", python=str(named), wrapped=True).version == "0.24.0"
    nothing_here.setenv("PRETUNER_ENGINE_PYTHON", str(named))
    assert choose_engine("vllm", wrapped=True).version == "0.24.0"


def test_behind_a_serve_cmd_r01_records_no_version_of_this_machine(
        nothing_here: pytest.MonkeyPatch) -> None:
    """Rule: an r0.1 server behind --serve-cmd is not this machine's vllm-mindspore either. Its
    version would pick the scripts' variant: 0.4 here would drop the r0.1 variables the run
    proved, so the run records none (the scripts keep r0.1's)."""
    nothing_here.setattr(registry, "installed_version", lambda *names: "0.4.0")  # here
    choice = choose_engine("vllm-mindspore-r01", wrapped=True)
    assert (choice.version, choice.simulated) == (None, False)
    assert "0.4.0" not in choice.reason


def test_a_missing_engine_says_how_to_point_at_it(nothing_here: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineMissing) as err:
        choose_engine("vllm")
    assert sys.executable in err.value.message  # where it looked
    for way in ("--engine-python", "PRETUNER_ENGINE_PYTHON", "--serve-cmd", "--emulate"):
        assert way in (err.value.hint or "")


def test_only_auto_falls_back_and_says_why_and_how(nothing_here: pytest.MonkeyPatch) -> None:
    choice = choose_engine("auto")
    assert choice.simulated
    assert "EMULATED" in choice.reason
    assert "vLLM-MindSpore is not installed" in choice.reason
    assert "--engine-python" in choice.reason
    assert "--serve-cmd" in choice.reason


def test_plan_launches_nothing_and_never_refuses_a_missing_engine(
        nothing_here: pytest.MonkeyPatch) -> None:
    assert choose_engine("vllm", launch=False).simulated
    assert invoke("plan", "--model", "qwen3-8b", "--engine", "vllm", "--card", "80",
                  env=cli_env()).returncode == 0


def test_emulate_and_an_engine_python_contradict() -> None:
    with pytest.raises(BadInputError, match="--emulate"):
        choose_engine("vllm", emulate=True, python="/x/bin/python")
    with pytest.raises(BadInputError, match="for V1 engines"):
        choose_engine("vllm-mindspore-r01", python="/x/bin/python")


def test_the_engine_in_another_python_is_found_there(tmp_path: Path,
                                                     nothing_here: pytest.MonkeyPatch) -> None:
    python = other_venv(tmp_path)
    nothing_here.setattr(registry, "_no_devices", lambda kind: None)  # GPUs show
    choice = choose_engine("vllm", python=str(python))
    assert (choice.simulated, choice.version, choice.python) == (False, "0.24.0", str(python))
    with pytest.raises(EngineMissing, match=f"vllm-ascend is not installed in {python}"):
        choose_engine("vllm-ascend", python=str(python))
    nothing_here.setenv("PRETUNER_ENGINE_PYTHON", str(python))  # the option's variable
    assert choose_engine("vllm").python == str(python)
    assert choose_engine("auto").name == "vllm"


def test_the_old_variable_still_names_vllm_cpus_python(tmp_path: Path,
                                                       nothing_here: pytest.MonkeyPatch) -> None:
    python = other_venv(tmp_path, "vllm-cpu", "0.32.0")
    nothing_here.setenv("PRETUNER_VLLM_PYTHON", str(python))
    choice = choose_engine("vllm-cpu")
    assert (choice.version, choice.python) == ("0.32.0", str(python))
    assert choose_engine("auto").name == "vllm-cpu"


@pytest.mark.parametrize(("engine", "dist", "head"), [
    ("vllm", "vllm", ["bin/vllm", "serve"]),
    ("vllm-cpu", "vllm-cpu", ["bin/python", "-m", "vllm.entrypoints.openai.api_server"]),
])
def test_run_checks_and_launches_the_engine_python(tmp_path: Path, engine: str, dist: str,
                                                   head: list[str]) -> None:
    python = other_venv(tmp_path / "venv", dist)
    env = gpu_host(tmp_path)
    done = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--card", "80",
                  "--engine-python", str(python), "--dry-run", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["simulated"] is False
    assert str(python) in shown["engine_reason"]
    argv = shown["first_launch"]["argv"]
    start = argv.index(str(tmp_path / "venv" / head[0]))
    assert argv[start:start + len(head)] == [str(tmp_path / "venv" / head[0]), *head[1:]]


def test_a_missing_engine_is_exit_2_before_any_folder(tmp_path: Path) -> None:
    env = {k: v for k, v in gpu_host(tmp_path).items()
           if k not in ("PRETUNER_ENGINE_PYTHON", "PRETUNER_VLLM_PYTHON")}
    work = tmp_path / "work"
    work.mkdir()
    done = invoke("run", "--model", "qwen3-8b", "--engine", "vllm", "--card", "80",
                  "--out", str(work / "r"), env=env, cwd=work)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "--engine vllm: vllm is not installed" in line
    assert "--engine-python" in line
    assert "--emulate" in line
    assert list(work.iterdir()) == []


def test_a_serve_cmd_with_a_named_engine_is_the_real_engine(tmp_path: Path) -> None:
    argv = ["run", "--model", "qwen3-8b", "--engine", "vllm", "--card", "80", "--dry-run",
            "--json", "--serve-cmd", "docker run --gpus all vllm/vllm-openai:latest"]
    real = json.loads(invoke(*argv, env=cli_env()).stdout)
    assert real["simulated"] is False
    assert real["first_launch"]["argv"][:3] == ["docker", "run", "--gpus"]
    assert json.loads(invoke(*argv, "--emulate", env=cli_env()).stdout)["simulated"] is True


@pytest.mark.slow  # an emulated full run
def test_auto_says_loudly_that_it_runs_the_emulated_card(
        finished_run: Callable[..., FinishedRun]) -> None:
    run = finished_run(*R01_QWEN_64)
    assert run.proc.returncode == 0, run.proc.stderr
    [warning] = [line for line in run.proc.stderr.splitlines() if line.startswith("WARNING")]
    assert "EMULATED" in warning
    assert "--engine-python" in warning
