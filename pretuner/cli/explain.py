"""`pretuner explain FLAG`: what a memory flag really does, with a run's figure beside it."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pretuner.cli.app import app
from pretuner.cli.render import emit
from pretuner.cli.script import finished_run
from pretuner.errors import BadInputError

if TYPE_CHECKING:
    from pretuner.explain.flags import FlagDoc

# The flag texts are imported where they are read: `pretuner --help` and a usage error answer
# without them (tests/test_cli_startup.py).


@app.command(
    "explain",
    short_help="What a memory flag really does (offload, swap, KV pinning...).",
    # FLAG is spelled like an option (--cpu-offload-gb): let it through as the argument.
    context_settings={"ignore_unknown_options": True},
    epilog="""\b
Examples:
  pretuner explain --cpu-offload-gb              weights to the host, paid every step
  pretuner explain swap-space --run runs/<run>   with the run's own figure
  pretuner explain                               every flag, one line each""",
)
def explain_cmd(
    flag: str | None = typer.Argument(
        None, metavar="FLAG", help="A flag (--cpu-offload-gb, swap-space) or an r0.1 variable."
    ),
    run: Path | None = typer.Option(
        None, "--run", metavar="RUN", help="A run folder: show its measured figure too."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Say what FLAG does in the engine's own terms (memory, speed, what it is not)."""
    from pretuner.explain.flags import FLAGS, find
    from pretuner.explain.measured import MEASURED

    if flag is None:
        width = max(len(d.name) for d in FLAGS)
        emit(as_json, {"flags": [{"flag": d.name, "summary": d.summary} for d in FLAGS]},
             "\n".join(f"{d.name:<{width}}  {d.summary}" for d in FLAGS))
        return
    doc = find(flag)
    if doc is None:
        bare = {d.name.lstrip("-"): d.name for d in FLAGS}
        close = [bare[c] for c in difflib.get_close_matches(flag.lstrip("-"), list(bare), n=3,
                                                            cutoff=0.5)]
        raise BadInputError(
            f"no memory flag named {flag!r}",
            hint=f"did you mean {', '.join(close)}?" if close
            else "run `pretuner explain` for the list")
    figures = MEASURED[doc.name](finished_run(run)) if run is not None else None
    emit(as_json, {"flag": doc.name, "engines": doc.engines, "summary": doc.summary,
                   "does": list(doc.does), "not": doc.not_this, "run": str(run) if run else None,
                   "measured": figures}, render(doc, figures, run))


def render(doc: FlagDoc, figures: list[str] | None, run: Path | None) -> str:
    lines = [f"{doc.name} ({doc.engines}): {doc.summary}", ""]
    lines += [f"- {text}" for text in doc.does]
    lines += ["", f"Not: {doc.not_this}"]
    if figures is not None:
        lines += ["", f"In run {run}:"] + [f"  {line}" for line in figures]
    return "\n".join(lines)
