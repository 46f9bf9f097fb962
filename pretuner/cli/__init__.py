"""Command-line interface: typer only. Each module registers one command group on `app`."""

from pretuner.cli.app import app, main

__all__ = ["app", "main"]

# Imported for what importing does: each registers its command (or command group) on `app`.
from pretuner.cli import (  # noqa: E402, F401, I001
    analyze, explain, models, plan, presets, report, run, scan, script, sim, sweep,
)
