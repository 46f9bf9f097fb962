"""Guarded startup files: serve.sh carries the proof's fingerprint and checks it before it
starts the engine, against the emulated nvidia-smi / npu-smi and an engine version that
importlib.metadata reads (a dist-info folder, as pip leaves it). Real bash, real subprocesses."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pretuner.deploy.context import Proof, ScriptOptions, proof_of
from pretuner.deploy.render import render_scripts, run_scripts
from pretuner.deploy.targets import GUARD_FILE, Target
from pretuner.presets.model import KvBasis, Preset, get_preset
from pretuner.report.records import RunReport, read_report

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_RUN = Path(__file__).parent / "golden" / "run"


def _shims(bin_dir: Path) -> None:
    """`vllm` that says it started, the emulated device tools, all first on PATH."""
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text('#!/bin/sh\necho "started vllm $*"\n')
    py = shlex.quote(sys.executable)
    for tool in ("nvidia-smi", "npu-smi"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec {py} -m pretuner.sim {tool} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def _site(tmp: Path, version: str) -> Path:
    """A folder where importlib.metadata finds vllm `version` installed."""
    info = tmp / f"site-{version}" / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return info.parent


def _env(tmp: Path, version: str, profile: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRETUNER_", "CUDA_"))}
    return env | {
        "PATH": f"{tmp / 'bin'}:{env['PATH']}",
        "PYTHONPATH": f"{_site(tmp, version) if version else ''}:{ROOT}",
        "PRETUNER_ENGINE_PYTHON": sys.executable,
        "PRETUNER_SIM_PROFILE": profile,
        "PRETUNER_SIM_STATE_DIR": str(tmp / "card"),
    } | extra


def _nvidia_smi(env: dict[str, str]) -> tuple[str, int, int]:
    """(name, total MiB, free MiB) of GPU 0 as the emulated nvidia-smi prints them."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free",
                          "--format=csv,noheader,nounits", "-i", "0"],
                         env=env, capture_output=True, text=True, check=True).stdout
    name, total, free = (x.strip() for x in out.splitlines()[0].split(","))
    return name, int(total), int(free)


def _v1_preset(engine: str) -> Preset:
    """A shipped preset as `engine` pins it (its KV bytes with --kv-cache-memory-bytes)."""
    p = get_preset("qwen3-vl-8b-tp2-64g-vllm-ascend")
    return replace(p, engine=engine, kv_basis=KvBasis.PINNED, kv_cache_memory_bytes=p.kv_bytes,
                   server_command=None, server_flags=None)


def _serve(tmp: Path, proof: Proof, env: dict[str, str], *args: str,
           preset: Preset | None = None) -> subprocess.CompletedProcess[str]:
    files = render_scripts(preset or _v1_preset("vllm"), ScriptOptions(proof=proof),
                           [Target.SERVE])
    script = tmp / "serve.sh"
    script.write_text(files["serve.sh"])
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.fixture
def cuda(tmp_path: Path) -> tuple[Path, Proof]:
    """A proof of vLLM 0.24.0 on the emulated H100 as its nvidia-smi shows it now."""
    _shims(tmp_path / "bin")
    name, total, free = _nvidia_smi(_env(tmp_path, "", "h100-80"))
    return tmp_path, Proof("vllm", "vllm", "0.24.0", "nvidia-smi", "CUDA_VISIBLE_DEVICES",
                           name, total, free)


def test_unchanged_fingerprint_starts(cuda: tuple[Path, Proof]) -> None:
    """The rule: where nothing the proof ran on changed, serve.sh starts the engine."""
    tmp, proof = cuda
    done = _serve(tmp, proof, _env(tmp, "0.24.0", "h100-80"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("started vllm serve ")
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("version", "profile", "args", "changed"),
    [
        ("0.25.0", "h100-80", (), "vllm is 0.25.0 here, the proof ran 0.24.0"),
        ("", "h100-80", (), "vllm is not installed here"),
        ("0.24.0", "a100-80", (), "in total (nvidia-smi), the proof ran on 81559 MiB"),
        ("0.24.0", "h100-nvl-94", (), "the proof ran on 81559 MiB"),
        ("0.24.0", "h100-80", ("--max-num-seqs", "2048"), "the extra flag --max-num-seqs"),
        ("0.24.0", "h100-80", ("--max_model_len=65536",), "the extra flag --max_model_len=65536"),
    ],
)
def test_a_changed_fingerprint_refuses_in_one_line(
    cuda: tuple[Path, Proof], version: str, profile: str, args: tuple[str, ...], changed: str
) -> None:
    """The rule: a changed engine version, device or memory flag stops serve.sh before the
    engine starts, with one line naming the change and the re-tune; PRETUNER_SKIP_GUARD=1
    starts it anyway and says it is unproven."""
    tmp, proof = cuda
    done = _serve(tmp, proof, _env(tmp, version, profile), *args)
    assert done.returncode == 78
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert changed in lines[0]
    assert "re-tune (pretuner run --model qwen3-vl-8b-instruct --engine vllm " in lines[0]
    assert "PRETUNER_SKIP_GUARD=1" in lines[0]
    forced = _serve(tmp, proof, _env(tmp, version, profile, PRETUNER_SKIP_GUARD="1"), *args)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.startswith("started vllm serve ")
    assert "starting UNPROVEN" in forced.stderr
    assert changed in forced.stderr


def test_less_free_memory_than_the_proof_started_from_refuses(
    cuda: tuple[Path, Proof],
) -> None:
    """The rule: another tenant on the device (less free memory than at the proof's start)
    is a changed fingerprint too."""
    tmp, proof = cuda
    env = _env(tmp, "0.24.0", "h100-80", PRETUNER_SIM_OCCUPIED_MIB="2048")
    done = _serve(tmp, proof, env)
    assert done.returncode == 78
    assert f"the proof started from {proof.free_mib} MiB free" in done.stderr


def test_a_device_the_tool_does_not_show_refuses(cuda: tuple[Path, Proof]) -> None:
    """The rule: no answer from the device tool is no proof (never a silent start)."""
    tmp, proof = cuda
    done = _serve(tmp, proof, _env(tmp, "0.24.0", "h100-80", CUDA_VISIBLE_DEVICES="99"))
    assert done.returncode == 78
    assert "nvidia-smi shows no device 99 here" in done.stderr


def test_npu_smi_total_is_checked(tmp_path: Path) -> None:
    """The rule: on Ascend the device total comes from npu-smi (the emulated 64 GB card passes,
    the 32 GB one refuses)."""
    _shims(tmp_path / "bin")
    preset = _v1_preset("vllm-ascend")
    proof = Proof("vllm-ascend", None, None, "npu-smi", "ASCEND_RT_VISIBLE_DEVICES", "910B3",
                  65536, None)
    assert preset.engine == "vllm-ascend"
    ok = _serve(tmp_path, proof, _env(tmp_path, "", "910b-64"), preset=preset)
    assert ok.returncode == 0, ok.stderr
    bad = _serve(tmp_path, proof, _env(tmp_path, "", "910b-32"), preset=preset)
    assert bad.returncode == 78
    assert "device 0 has 32768 MiB in total (npu-smi), the proof ran on 65536 MiB" in bad.stderr
    # the chip name npu-smi prints in the row above the memory: a 910B4 proof is not a 910B3's
    renamed = _serve(tmp_path, replace(proof, device_name="910B4"),
                     _env(tmp_path, "", "910b-64"), preset=preset)
    assert renamed.returncode == 78
    assert renamed.stderr.splitlines()[0].startswith(
        "pretuner guard: device 0 is 910B3, the proof ran on 910B4: re-tune")


def _stack_site(tmp: Path, torch: str | None, cuda: str, cann: str) -> dict[str, str]:
    """torch `torch` built for CUDA `cuda` (dist-info, and a torch/version.py that is read,
    never imported), and CANN `cann`'s install file: the environment's additions."""
    site = tmp / f"stack-{torch}-{cuda}"
    if torch is not None:
        info = site / f"torch-{torch}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch}\n")
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text("raise RuntimeError('imported torch')\n")
        (site / "torch" / "version.py").write_text(
            f"from typing import Optional\n__version__ = '{torch}'\ncuda: Optional[str] = '{cuda}'\n")
    toolkit = tmp / f"cann-{cann}"
    (toolkit / "x86_64-linux").mkdir(parents=True, exist_ok=True)
    (toolkit / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        f"package_name=Ascend-cann-toolkit\nversion={cann}\narch=x86_64\nos=linux\n")
    return {"STACK_SITE": str(site), "ASCEND_TOOLKIT_HOME": str(toolkit)}


STACK = {"torch": "2.9.0", "cuda": "12.8", "cann": "8.3.RC1"}


@pytest.mark.parametrize(
    ("torch", "built_for", "cann", "device", "changed"),
    [
        ("2.9.0", "12.8", "8.3.RC1", None, None),
        ("2.8.0", "12.8", "8.3.RC1", None, "torch is 2.8.0 here, the proof ran 2.9.0"),
        ("2.9.0", "12.6", "8.3.RC1", None, "torch's CUDA is 12.6 here, the proof ran 12.8"),
        (None, "12.8", "8.3.RC1", None, "torch is not installed here, the proof ran 2.9.0"),
        ("2.9.0", "12.8", "8.2.RC1", None, "CANN is 8.2.RC1 here, the proof ran 8.3.RC1"),
        ("2.9.0", "12.8", "8.3.RC1", "NVIDIA H200",
         "device 0 is NVIDIA H100 80GB HBM3, the proof ran on NVIDIA H200"),
    ],
)
def test_a_changed_software_stack_or_device_name_refuses_in_one_line(
    cuda: tuple[Path, Proof], torch: str | None, built_for: str, cann: str, device: str | None,
    changed: str | None,
) -> None:
    """The rule: serve.sh reads torch, torch's CUDA (torch/version.py as text, torch never
    imported) and CANN as the run read them, and the device's name; any that changed stops
    it with one line naming it; PRETUNER_SKIP_GUARD=1 starts anyway."""
    tmp, proof = cuda
    proof = replace(proof, stack=STACK, distributions=("vllm",),
                    device_name=device or proof.device_name)
    extra = _stack_site(tmp, torch, built_for, cann)
    env = _env(tmp, "0.24.0", "h100-80", **extra)
    env["PYTHONPATH"] = f"{extra['STACK_SITE']}:{env['PYTHONPATH']}"
    done = _serve(tmp, proof, env)
    if changed is None:
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        return
    assert done.returncode == 78
    [line] = done.stderr.splitlines()
    assert line.startswith(f"pretuner guard: {changed}: re-tune (pretuner run ")
    forced = _serve(tmp, proof, env | {"PRETUNER_SKIP_GUARD": "1"})
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.startswith("started vllm serve ")
    assert f"{changed}; PRETUNER_SKIP_GUARD=1: starting UNPROVEN" in forced.stderr


def test_only_a_run_gets_a_guard() -> None:
    """The rule: a preset (nothing proven here) renders no guard; a run record does, in
    serve.sh and, for the systemd unit, as its ExecStartPre."""
    preset = render_scripts(_v1_preset("vllm"), ScriptOptions(), [Target.ALL])
    assert GUARD_FILE not in preset
    assert "pretuner_guard" not in preset["serve.sh"]
    rep = read_report(GOLDEN_RUN)
    assert isinstance(rep, RunReport)
    run = run_scripts(rep, ScriptOptions(), [Target.ALL])
    assert "pretuner_guard" in run["serve.sh"]
    assert "pretuner_guard" in run[GUARD_FILE]
    assert f"ExecStartPre=/etc/pretuner/{GUARD_FILE}" in run["pretuner-serve.service"]


def test_proof_of_reads_the_final_launch() -> None:
    """The rule: the fingerprint's device total and free memory are the last launch's that
    recorded the device (free = total - used as the launch began)."""
    rep = read_report(GOLDEN_RUN)
    assert isinstance(rep, RunReport)
    step = rep.steps[-1].model_copy(update={"device_total_mib": 65536,
                                            "device_peaks_mib": {"launch": 3379}})
    rep = rep.model_copy(update={"steps": [*rep.steps[:-1], step], "engine_version": "0.1"})
    proof = proof_of(rep)
    assert (proof.device_tool, proof.device_total_mib, proof.free_mib) == (
        "npu-smi", 65536, 65536 - 3379)
    assert proof.version == "0.1"


def test_a_real_runs_fingerprint_and_retune() -> None:
    """The rule: a real run's guard checks what its record says it ran on (engine version,
    device total, free memory at the final launch's start) and names the run again, with every
    option it was given, as the re-tune."""
    folder = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200" / "run8k"
    raw = json.loads((folder / "report.json").read_text())
    rep = read_report(folder)
    assert isinstance(rep, RunReport)
    proof = proof_of(rep)
    last = raw["steps"][-1]
    assert (proof.version, proof.device_total_mib, proof.free_mib) == (
        raw["engine_version"], last["device_total_mib"],
        last["device_total_mib"] - last["device_peaks_mib"]["launch"])
    serve = run_scripts(rep, ScriptOptions(), [Target.SERVE])["serve.sh"]
    assert f"retune={shlex.quote(shlex.join(raw['retune_command']))}\n" in serve


def test_every_device_of_the_layout_is_checked(cuda: tuple[Path, Proof]) -> None:
    """The rule: a TP x PP proof holds on as many devices as it ran on, each checked; fewer
    visible devices than the layout refuses in one line."""
    tmp, proof = cuda
    tp2 = replace(proof, devices=2)
    both = _serve(tmp, tp2, _env(tmp, "0.24.0", "h100-80"))
    assert both.returncode == 0, both.stderr
    one = _serve(tmp, tp2, _env(tmp, "0.24.0", "h100-80", CUDA_VISIBLE_DEVICES="0"))
    assert one.returncode == 78
    assert ("CUDA_VISIBLE_DEVICES names fewer than 2 devices here (0), the proof ran on 2"
            in one.stderr)
    gone = _serve(tmp, tp2, _env(tmp, "0.24.0", "h100-80", CUDA_VISIBLE_DEVICES="0,99"))
    assert gone.returncode == 78
    assert "nvidia-smi shows no device 99 here" in gone.stderr


def test_the_guard_asks_the_python_the_run_found_the_engine_in(cuda: tuple[Path, Proof]) -> None:
    """The rule: an engine in a venv of its own is checked in that venv's Python (the one the
    run found it in), not in whatever `python3` the shell has; PRETUNER_ENGINE_PYTHON still
    names another."""
    tmp, proof = cuda
    venv = tmp / "venv" / "bin" / "python"
    venv.parent.mkdir(parents=True)
    venv.write_text(f'#!/bin/sh\nPYTHONPATH={_site(tmp, "0.24.0")} exec {sys.executable} "$@"\n')
    venv.chmod(0o755)
    env = {k: v for k, v in _env(tmp, "", "h100-80").items() if k != "PRETUNER_ENGINE_PYTHON"}
    found = _serve(tmp, replace(proof, python=str(venv)), env)
    assert found.returncode == 0, found.stderr
    shell = _serve(tmp, proof, env | {"PATH": f"{tmp / 'bin'}:/usr/bin:/bin"})
    assert shell.returncode == 78
    assert "vllm is not installed here, the proof ran 0.24.0" in shell.stderr
    other = _serve(tmp, replace(proof, python=str(venv)),
                   env | {"PRETUNER_ENGINE_PYTHON": "/nonexistent/python"})
    assert "vllm is not installed here" in other.stderr
