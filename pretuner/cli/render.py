"""Plain-text rendering helpers shared by the commands: aligned tables and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import typer


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned text columns, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]
    out = []
    for n, row in enumerate(cells):
        parts = [c.rjust(w) if numeric[i] and n > 0 else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(parts).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) or (
        isinstance(value, str) and value.replace(",", "").replace(".", "").isdigit()
    )


def echo_json(data: dict[str, Any]) -> None:
    """One JSON object on stdout, with `schema_version` first."""
    from pretuner.report import SCHEMA_VERSION  # not the pydantic records: `scan --json` is timed

    typer.echo(json.dumps({"schema_version": SCHEMA_VERSION, **data}, indent=2))


def emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    """What a command prints on stdout: its `--json` object, or its text."""
    if as_json:
        echo_json(data)
    else:
        typer.echo(text)


def warn(message: str) -> None:
    typer.echo(f"pretuner: warning: {message}", err=True)
