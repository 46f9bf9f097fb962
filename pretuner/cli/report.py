"""`pretuner report`: report.html for a run folder."""

from __future__ import annotations

from pathlib import Path

import typer

from pretuner.cli.app import app
from pretuner.cli.render import emit
from pretuner.errors import BadInputError


@app.command(
    "report",
    short_help="Write report.html: a self-contained page of a run.",
    epilog="""\b
Examples:
  pretuner report runs/<run>                      writes runs/<run>/report.html
  pretuner report runs/<run> --out /tmp/run.html""",
)
def report_cmd(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run folder with report.json."),
    out: Path | None = typer.Option(
        None, "--out", metavar="FILE", help="Write the page here (default: RUN_DIR/report.html)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file."),
    as_json: bool = typer.Option(False, "--json", help="Print the page's path as JSON."),
) -> None:
    """Write one HTML page (no network, no script): the headline, the memory per card, memory
    over time of every launch, and the decisions."""
    from pretuner.report.html.page import PAGE, write_html  # jinja2: not for `pretuner --help`

    target = out if out is not None else run_dir / PAGE
    if target.exists() and not overwrite:
        raise BadInputError(
            f"{str(target)!r} already exists (a run writes its page when it ends)",
            hint="open it, pass --overwrite to render it again, or --out FILE",
        )
    path = write_html(run_dir, out, overwrite=overwrite)
    emit(as_json, {"report_html": str(path)}, str(path))
