"""`pretuner presets`: the catalog of tuned configurations."""

from __future__ import annotations

import datetime
import hashlib
import json
from enum import Enum
from pathlib import Path

import typer

from pretuner.cli.app import Group, app
from pretuner.cli.render import emit, table
from pretuner.cli.script import finished_run
from pretuner.errors import BadInputError
from pretuner.files import write_atomic

# The catalog is imported inside each command: `pretuner --help` and a usage error answer
# without loading it (tests/test_cli_startup.py).

presets_app = typer.Typer(
    help="Tuned presets with their provenance.",
    epilog="""\b
Examples:
  pretuner presets list
  pretuner presets show qwen3-8b-tp2-20g-vllm
  pretuner presets add runs/<run> --name my-qwen3-64g
  pretuner script --preset my-qwen3-64g --out deploy/""",
    no_args_is_help=True,
    cls=Group,
)
app.add_typer(presets_app, name="presets")


@presets_app.command("list")
def list_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print every preset's JSON, as a list."),
) -> None:
    """One line per preset."""
    from pretuner.presets.catalog import kv_words
    from pretuner.presets.model import all_presets, engine_words, preset_to_json

    presets = all_presets()
    rows = [(p.name, p.kind.value, p.model, p.card_gib, f"TP{p.tp}xPP{p.pp}", engine_words(p),
             kv_words(p), f"{p.kv_tokens:,}") for p in presets]
    head = ("preset", "kind", "model", "card GiB", "layout", "engine", "KV/card", "KV tokens/card")
    emit(as_json, {"presets": [preset_to_json(p) for p in presets]}, table(head, rows))


@presets_app.command("show")
def show_cmd(
    name: str = typer.Argument(
        ..., metavar="NAME", help="Preset name, or a preset file (NAME.json)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the preset's JSON."),
) -> None:
    """A preset's configuration, source and derivation."""
    from pretuner.presets.catalog import derivation_lines, kv_words
    from pretuner.presets.model import engine_words, preset_to_json, resolve_preset

    p = resolve_preset(name)
    emit(as_json, preset_to_json(p), "\n".join([
        f"{p.name} ({p.kind.value}): {p.model} on {p.card_gib} GiB, TP{p.tp} x PP{p.pp}",
        f"engine: {engine_words(p)}; KV cache {kv_words(p)} per card",
        f"source: {p.source}",
        *derivation_lines(p)]))


@presets_app.command("add")
def add_cmd(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A finished run folder (report.json)."
    ),
    name: str | None = typer.Option(
        None, "--name", metavar="NAME", help="Preset name (default: derived)."
    ),
    out: Path | None = typer.Option(
        None, "--out", metavar="DIR",
        help="Folder of preset files to add it to (default: your presets folder, "
        "$PRETUNER_PRESETS_DIR or ~/.local/share/pretuner/presets; a checkout's "
        "pretuner/presets/data to ship it).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the preset's name and file."),
) -> None:
    """Turn a run record into a preset file; `presets list/show` and `script --preset` find it."""
    from pretuner.presets import model

    if name is not None:  # a name that no file or `presets list` could read back is refused
        model.check_name(name, "--name")
    p = model.preset_from_report(finished_run(run_dir), name=name,
                                 date=datetime.date.today().isoformat())
    problems = model.check_preset(p)
    if problems:
        raise BadInputError(f"run record disagrees with the KV math: {problems[0]}")
    if out is None:
        if p.name in {q.name for q in model.all_presets()}:
            raise BadInputError(
                f"a preset named {p.name!r} exists already", hint="pass --name NEW-NAME"
            )
        out = model.user_presets_dir()
        out.mkdir(parents=True, exist_ok=True)
    path = write_atomic(
        Path(out) / f"{p.name}.json", json.dumps(model.preset_to_json(p), indent=2) + "\n"
    )
    emit(as_json, {"preset": p.name, "file": str(path)},
         f"{path}  (pretuner presets show {p.name}; pretuner script --preset {p.name})")


class ExportFormat(str, Enum):
    VLLM_RECIPE = "vllm-recipe"


@presets_app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A finished, validated run folder (report.json)."
    ),
    fmt: ExportFormat = typer.Option(
        ExportFormat.VLLM_RECIPE, "--format",
        help="vllm-recipe (the only one so far): a vLLM recipes hardware_overrides block.",
    ),
    hardware: str | None = typer.Option(
        None, "--hardware", metavar="ID",
        help="The recipes hardware profile of the run's card (default: from its name).",
    ),
    out: Path | None = typer.Option(
        None, "--out", metavar="FILE", help="Write here (default: print); never overwritten."
    ),
) -> None:
    """A proven run in the ecosystem's format, with the proof's evidence."""
    from pretuner.presets.recipe import recipe_block, recipe_yaml

    rep = finished_run(run_dir)
    report = Path(run_dir) / "report.json" if Path(run_dir).is_dir() else Path(run_dir)
    digest = hashlib.sha256(report.read_bytes()).hexdigest()
    text = recipe_yaml(recipe_block(rep, digest, hardware, datetime.date.today().isoformat()))
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_atomic(out, text)


@presets_app.command("docs")
def docs_cmd(
    out: Path | None = typer.Option(
        None, "--out", metavar="FILE", help="Write here (default: print)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file."),
) -> None:
    """The readable catalog (docs/presets.md)."""
    from pretuner.presets.catalog import catalog_markdown
    from pretuner.presets.model import builtin_presets

    text = catalog_markdown(builtin_presets())
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_atomic(out, text, overwrite=overwrite)
