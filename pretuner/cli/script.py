"""`pretuner script`: startup scripts from a run record or a preset."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from pretuner.cli.app import app
from pretuner.errors import BadInputError
from pretuner.presets import get_preset, preset_from_report
from pretuner.presets.model import Preset
from pretuner.scripts import ScriptOptions, Target, render_scripts, write_scripts


def preset_from_run_dir(run_dir: Path) -> Preset:
    path = Path(run_dir) / "report.json"
    try:
        rep = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise BadInputError(
            f"cannot read {str(path)!r}: {err}", hint="pass a finished run folder"
        ) from None
    return preset_from_report(rep, date="-")


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise BadInputError(f"--env {item!r} lacks '='", hint="use --env KEY=VALUE")
        out[key] = value
    return out


@app.command("script")
def script_cmd(
    run_dir: Path | None = typer.Argument(None, help="A run folder with report.json."),
    preset: str | None = typer.Option(None, "--preset", help="A preset name instead of a run."),
    target: list[Target] = typer.Option(
        [Target.ALL], "--target", help="serve | env | config | ray | systemd | all (repeatable)."
    ),
    engine_version: str = typer.Option(
        "0.1", "--engine-version", help="vLLM-MindSpore version the scripts are for (0.1, 0.5...)."
    ),
    model_path: str | None = typer.Option(None, "--model-path", help="What the server loads."),
    nic: str = typer.Option("eth0", "--nic", help="Multi-node: the NIC between the nodes."),
    head_ip: str | None = typer.Option(None, "--head-ip", help="Multi-node: the head's address."),
    install_dir: str = typer.Option(
        "/etc/pretuner", "--install-dir", help="Where the systemd unit finds tuned.env."
    ),
    env: list[str] = typer.Option([], "--env", help="Extra KEY=VALUE to export (repeatable)."),
    out: Path | None = typer.Option(None, "--out", help="Write the files here (default: print)."),
) -> None:
    """Render serve.sh, tuned.env, a vLLM config YAML, Ray scripts and a systemd unit."""
    if (run_dir is None) == (preset is None):
        raise BadInputError("give a RUN_DIR or --preset NAME (one of them)")
    p = get_preset(preset) if preset is not None else preset_from_run_dir(Path(str(run_dir)))
    opts = ScriptOptions(
        engine_version=engine_version,
        model_path=model_path,
        nic=nic,
        head_ip=head_ip,
        install_dir=install_dir,
        extra_env=_env_pairs(env),
    )
    files = render_scripts(p, opts, list(target))
    if out is None:
        for name, text in files.items():
            typer.echo(f"==> {name} <==\n{text}")
        return
    for path in write_scripts(files, out):
        typer.echo(str(path))
