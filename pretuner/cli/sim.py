"""`pretuner sim`: the emulated Ascend card and vLLM-MindSpore r0.1 server, and the emulated
CUDA card with vLLM 0.24 (`sim vllm serve`, `sim nvidia-smi`); all figures simulated."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import typer

from pretuner.cli.app import Group, app

sim_app = typer.Typer(
    help="Emulated cards and servers (Ascend + vLLM-MindSpore r0.1, CUDA + vLLM V1) for tests "
    "and first runs (all memory figures are simulated).",
    short_help="Emulated cards and servers for tests and demos (simulated figures).",
    epilog="""\b
Examples:
  pretuner sim npu-smi info                      the emulated Ascend cards
  pretuner sim vllm serve qwen3-8b --port 8000   an emulated vLLM 0.24 on an H100 80 GB
  PRETUNER_SIM_PROFILE=cuda-24 pretuner sim nvidia-smi""",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=Group,
)
app.add_typer(sim_app, name="sim")

_PASS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
# Each runs `python -m pretuner.sim NAME ...` in this process (the emulator's own argv).
_COMMANDS = {
    "serve": "Run the emulated server; takes the vLLM-MindSpore command line "
             "(see `pretuner sim serve --help`).",
    "launch": "r0.1 launcher: run the server as a subprocess.run child, like "
              "`python -m vllm_mindspore.entrypoints vllm.entrypoints.openai.api_server ...`.",
    "npu-smi": "Print `npu-smi info` for the emulated cards.",
    "vllm": "Emulated vLLM 0.24 on an emulated CUDA card: `pretuner sim vllm serve MODEL ...` "
            "takes `vllm serve`'s command line (PRETUNER_SIM_PROFILE picks the card).",
    "nvidia-smi": "Print `nvidia-smi` (table or --query-gpu CSV) for the emulated CUDA cards.",
}


def _passthrough(name: str) -> Callable[[typer.Context], None]:
    def run(ctx: typer.Context) -> None:
        from pretuner.sim.__main__ import main

        raise typer.Exit(main([name, *ctx.args]))

    return run


for _name, _help in _COMMANDS.items():
    sim_app.command(_name, context_settings=_PASS, add_help_option=False,
                    help=_help)(_passthrough(_name))


@sim_app.command("install-shim")
def install_shim(
    directory: Path = typer.Argument(
        ..., metavar="DIR", help="Folder to write an executable `npu-smi` into."
    ),
) -> None:
    """Write an `npu-smi` script that runs the emulated one; put DIR first on PATH."""
    from pretuner.sim.npusmi import write_shim

    path = write_shim(directory, sys.executable)
    typer.echo(str(path))
