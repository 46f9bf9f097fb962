"""Command-line interface: typer only. Each module registers one command group on `app`."""

from pretuner.cli.app import app, main

__all__ = ["app", "main"]

from pretuner.cli import analyze as _analyze  # noqa: E402, F401  (registers the command)
from pretuner.cli import explain as _explain  # noqa: E402, F401  (registers the command)
from pretuner.cli import models as _models  # noqa: E402, F401  (registers the command group)
from pretuner.cli import plan as _plan  # noqa: E402, F401  (registers the command)
from pretuner.cli import presets as _presets  # noqa: E402, F401  (registers the command group)
from pretuner.cli import report as _report  # noqa: E402, F401  (registers the command)
from pretuner.cli import run as _run  # noqa: E402, F401  (registers the command)
from pretuner.cli import scan as _scan  # noqa: E402, F401  (registers the command)
from pretuner.cli import script as _script  # noqa: E402, F401  (registers the command)
from pretuner.cli import sim as _sim  # noqa: E402, F401  (registers the command group)
from pretuner.cli import sweep as _sweep  # noqa: E402, F401  (registers the command)
