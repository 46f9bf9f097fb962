"""What an r0.1 run launches: the model argument the server loads, the emulated card's
environment, and the check that the server command is installed before a run folder exists."""

from __future__ import annotations

import os
import shutil
import subprocess

from pretuner.emulation import emulator
from pretuner.errors import BadInputError
from pretuner.models import ModelSpec, local_model_path
from pretuner.tune.backends import BackendChoice
from pretuner.tune.options import RunOptions
from pretuner.tune.settings import Backend


def sim_env(
    opts: RunOptions, choice: BackendChoice, weights_format: str, nodes: int
) -> dict[str, str]:
    if choice.backend is not Backend.SIM:
        return dict(opts.sim_env)
    env = emulator().launch_env("r01", opts.card_gib, opts.seed, os.environ,
                                weights_format=weights_format, nodes=nodes)
    return {**env, **opts.sim_env}


def server_model_arg(model: str, spec: ModelSpec, backend: Backend) -> str:
    """What the server loads: a folder by its absolute path; a registry name as its Hugging
    Face id for a real vLLM-MindSpore (which cannot load `qwen3-8b`); pretuner's own servers
    take the name."""
    if (local := local_model_path(model)) is not None:
        return local
    if backend in (Backend.SIM, Backend.MINDSPORE_CPU):
        return model
    return spec.hf_id or model


def check_server_installed(base_cmd: list[str]) -> None:
    """Refuse, before a run folder exists, a server command whose program or Python module is
    not installed here (exit 2), instead of finding out from the first launch's log."""
    program = shutil.which(base_cmd[0])
    if program is None:
        raise BadInputError(
            f"the server command {base_cmd[0]!r} is not on PATH",
            hint="install the engine (pip install vllm-mindspore) in this environment, pass "
            "the whole command with --serve-cmd, or --backend sim for the emulated card",
        )
    if len(base_cmd) > 2 and base_cmd[1] == "-m":
        module = base_cmd[2].split(".")[0]
        probe = subprocess.run(
            [program, "-c", f"import importlib.util, sys; "
             f"sys.exit(importlib.util.find_spec({module!r}) is None)"],
            capture_output=True, timeout=60, check=False,
        )
        if probe.returncode != 0:
            raise BadInputError(
                f"{base_cmd[0]} ({program}) cannot import {module!r}: the engine is not "
                "installed for it",
                hint="install the engine (pip install vllm-mindspore) for that Python, pass "
                "the whole command with --serve-cmd, or --backend sim for the emulated card",
            )
