"""The startup files of a preset or run: rendered (`pretuner.templating`), written atomically."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from pretuner.deploy.context import ScriptOptions, build_context, proof_of
from pretuner.deploy.targets import GUARD_FILE, Target, files_for
from pretuner.errors import BadInputError
from pretuner.files import write_atomic
from pretuner.presets.model import Preset, preset_from_report
from pretuner.report.records import R01Derivation, RunReport
from pretuner.templating import render_template


def render_scripts(p: Preset, opts: ScriptOptions, targets: list[Target]) -> dict[str, str]:
    """File name -> text for every requested target."""
    if re.search(r"[\s\"'%\\]", opts.install_dir) or not opts.install_dir.startswith("/"):
        raise BadInputError(
            f"--install-dir {opts.install_dir!r} must be an absolute path without spaces, "
            "quotes or %",
            hint="e.g. /etc/pretuner",
        )
    ctx = build_context(p, opts)
    return {name: render_template(tpl, ctx) for name, tpl in files_for(targets, p.nodes)
            if name != GUARD_FILE or ctx["guard"] is not None}


def run_scripts(rep: RunReport, opts: ScriptOptions, targets: list[Target]) -> dict[str, str]:
    """A finished run's startup files: those in its folder, and `pretuner script RUN`'s."""
    f = rep.final
    command = None
    if (isinstance(rep.derivation, R01Derivation) and f.engine_serve_command is None
            and opts.engine_version is None and opts.model_path is None):
        # The command the run proved (a --serve-cmd wrapper, the installed engine's); an
        # emulated card's run, or a version or path asked for, gets the version's command.
        command = tuple(f.serve_command[: len(f.serve_command) - len(f.flags)])
    status = "validated under full load" if rep.validated else "NOT validated"
    return render_scripts(preset_from_report(rep, date="-"),
                          replace(opts, command=command, status=status, proof=proof_of(rep)),
                          targets)


def write_scripts(files: dict[str, str], out: Path) -> list[Path]:
    """Write every file atomically into `out` (created if missing); never overwrite."""
    out = Path(out)
    clash = [n for n in files if (out / n).exists()]
    if clash:
        raise BadInputError(
            f"{str(out / clash[0])!r} already exists and pretuner never overwrites a file",
            hint="choose another --out folder",
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BadInputError(f"cannot create {str(out)!r}: {err.strerror}") from None
    return [
        write_atomic(out / name, text, executable=name.endswith(".sh"))
        for name, text in files.items()
    ]
