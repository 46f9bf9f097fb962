"""`pretuner presets`: the catalog of tuned configurations."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import typer

from pretuner.cli.app import app
from pretuner.cli.render import echo_json, table
from pretuner.cli.script import preset_from_run_dir
from pretuner.errors import BadInputError
from pretuner.files import write_atomic
from pretuner.presets import builtin_presets, check_preset, get_preset, preset_to_json
from pretuner.presets.catalog import catalog_markdown, derivation_lines

presets_app = typer.Typer(help="Tuned presets with their provenance.", no_args_is_help=True)
app.add_typer(presets_app, name="presets")


@presets_app.command("list")
def list_cmd() -> None:
    """One line per preset."""
    rows = [
        (p.name, p.kind.value, p.model, p.card_gib, f"TP{p.tp}xPP{p.pp}", f"{p.kv_tokens:,}")
        for p in builtin_presets()
    ]
    typer.echo(table(("preset", "kind", "model", "card GiB", "layout", "KV tokens/card"), rows))


@presets_app.command("show")
def show_cmd(
    name: str = typer.Argument(..., help="Preset name."),
    as_json: bool = typer.Option(False, "--json", help="Print the preset's JSON."),
) -> None:
    """A preset's configuration, source and derivation."""
    p = get_preset(name)
    if as_json:
        echo_json(preset_to_json(p))
        return
    typer.echo(f"{p.name} ({p.kind.value}): {p.model} on {p.card_gib} GiB, TP{p.tp} x PP{p.pp}")
    typer.echo(f"source: {p.source}")
    typer.echo("\n".join(derivation_lines(p)))


@presets_app.command("add")
def add_cmd(
    run_dir: Path = typer.Argument(..., help="A finished run folder (report.json)."),
    name: str | None = typer.Option(None, "--name", help="Preset name (default: derived)."),
    out: Path = typer.Option(
        Path("pretuner/presets/data"), "--out", help="Folder of preset files to add it to."
    ),
) -> None:
    """Turn a run record into a preset file (then commit it and regenerate the docs)."""
    p = preset_from_run_dir(run_dir)
    p = dataclasses.replace(p, name=name or p.name, date=datetime.date.today().isoformat())
    problems = check_preset(p)
    if problems:
        raise BadInputError(f"run record disagrees with the KV math: {problems[0]}")
    path = write_atomic(
        Path(out) / f"{p.name}.json", json.dumps(preset_to_json(p), indent=2) + "\n"
    )
    typer.echo(f"{path}  (next: pretuner presets docs --out docs/presets.md --overwrite)")


@presets_app.command("docs")
def docs_cmd(
    out: Path | None = typer.Option(None, "--out", help="Write here (default: print)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file."),
) -> None:
    """The readable catalog (docs/presets.md)."""
    text = catalog_markdown(builtin_presets())
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_atomic(out, text, overwrite=overwrite)
