"""`pretuner sweep FILE.yaml`: many tunings, one run folder each, one summary and presets."""

from __future__ import annotations

import datetime
import difflib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from pretuner.cli.app import app
from pretuner.cli.render import emit
from pretuner.errors import BadInputError, RunInterrupted

if TYPE_CHECKING:
    from pretuner.sweep import Planned, Tuning

# Options a tuning cannot set: the sweep gives each its folder and reads its record itself.
NOT_PER_TUNING = frozenset({"out", "resume", "json", "dry-run", "ray-address", "backend"})


@app.command(
    "sweep",
    short_help="Many tunings from a YAML list: one run folder each, a summary, presets.",
    epilog="""\b
FILE.yaml is a list of tunings, each `pretuner run` options by their long name:
  - {name: qwen-h100, model: qwen3-8b, engine: vllm, card: 80, max-model-len: 32K}
  - {model: qwen3-8b, engine: vllm-ascend, card: 64, tp: 2, max-num-seqs: 64}
  - {model: qwen3-8b, engine: vllm, emulate: true, card: 141, validate: false}

\b
Examples:
  pretuner sweep models.yaml                         one after another on this machine
  pretuner sweep models.yaml --ray-address auto      Ray tasks on the nodes' free devices
  pretuner sweep models.yaml --resume sweeps/<sweep> go on after Ctrl-C

\b
Exit codes: 0 every tuning validated as asked, 10 at least one did not (its own exit code and
reason are in summary.md), 2 bad input (the file's line), 7 Ray cluster, 130 interrupted.""",
)
def sweep_cmd(
    file: Path = typer.Argument(..., metavar="FILE.yaml", help="The list of tunings."),
    out: str | None = typer.Option(
        None, "--out", metavar="DIR",
        help="Sweep folder, a new one (default: sweeps/<FILE>-<time>).",
    ),
    resume: Path | None = typer.Option(
        None, "--resume", metavar="DIR",
        help="Continue this sweep folder: finished tunings are kept, interrupted ones resumed.",
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", metavar="HOST:PORT",
        help="Run the tunings as Ray tasks (HOST:PORT or auto), each holding its layout's "
        "GPUs or NPUs on a node that has them free (needs the `ray` extra).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print summary.json at the end."),
) -> None:
    """Tune every configuration of FILE.yaml: each one `pretuner run`, one failing does not stop
    the others; then SWEEP/summary.md, summary.json and SWEEP/presets/."""
    from pretuner.launch.process import install_signal_handlers
    from pretuner.sweep import finished, read_sweep, run_here, run_on_ray, write_summary

    tunings = read_sweep(file)
    for t in tunings:
        check_tuning(file, t)
    sweep_dir = _sweep_dir(file, out, resume)
    plans = [p for p in plan_tunings(tunings, file, ray_address is not None)
             if finished(sweep_dir / p.tuning.name) is None]
    results = {t.name: r for t in tunings if (r := finished(sweep_dir / t.name)) is not None}
    t0 = time.monotonic()

    def say(event: str, name: str, detail: str) -> None:
        typer.echo(f"[{time.monotonic() - t0:7.1f}s] {event:<7}{name}  {detail}", err=True)

    for name in results:
        say("kept", name, "finished in an earlier session")
    restore = install_signal_handlers()
    try:
        if ray_address is None:
            run_here(plans, sweep_dir, say, results)
        else:
            run_on_ray(ray_address, plans, sweep_dir, say, results)
    except KeyboardInterrupt:
        write_summary(tunings, results, sweep_dir)
        raise SweepInterrupted(file, sweep_dir) from None
    finally:
        restore()
    doc = write_summary(tunings, results, sweep_dir)
    emit(as_json, doc, f"{doc['validated']} of {len(tunings)} tunings validated: "
         f"{sweep_dir / 'summary.md'}")
    if doc["exit_code"]:
        raise typer.Exit(doc["exit_code"])


class SweepInterrupted(RunInterrupted):
    """Ctrl-C during a sweep: the finished tunings are kept, the running one resumable."""

    def __init__(self, file: Path, sweep_dir: Path) -> None:
        super().__init__(None)
        command = ["pretuner", "sweep", str(file), "--resume", str(sweep_dir)]
        self.hint = f"resume with: {shlex.join(command)}"


def _sweep_dir(file: Path, out: str | None, resume: Path | None) -> Path:
    """The sweep folder: `--resume`'s, else a new one (never an existing one: nothing a user
    made is overwritten)."""
    if resume is not None:
        if out is not None:
            raise BadInputError("--out cannot be given with --resume",
                                hint="the sweep goes on in the --resume folder")
        if not (resume / "sweep.yaml").exists():
            raise BadInputError(f"--resume {str(resume)!r} is not a sweep folder (no sweep.yaml)",
                                hint="pass the folder an earlier `pretuner sweep` wrote")
        return resume.resolve()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(out) if out else Path("sweeps") / f"{file.stem}-{stamp}"
    if folder.exists() and any(folder.iterdir()):
        raise BadInputError(f"--out {str(folder)!r} exists and is not empty",
                            hint="pass a new folder, or --resume it to continue that sweep")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.yaml").write_text(file.read_text())  # what it ran, beside its results
    return folder.resolve()


def _command(name: str) -> Any:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def _long_names(command: Any) -> dict[str, Any]:
    """`max-num-seqs` -> its parameter, for every long option of a command."""
    return {name[2:]: p for p in command.params for name in (*p.opts, *p.secondary_opts)
            if name.startswith("--")}


def _flags(params: dict[str, Any]) -> Any:
    def flags(key: str, value: Any) -> list[str]:
        param = params.get(key)
        if param is None:  # an option of `run` that `plan` does not take
            return []
        if not getattr(param, "is_flag", False):
            return [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
        if value is True:
            return [f"--{key}"]
        off = [n for n in param.secondary_opts if n.startswith("--")]
        return off[:1] if value is False and off else []
    return flags


def check_tuning(file: Path, t: Tuning) -> None:
    """Every key a `run` option, every value one `run` takes: one line naming the file's line."""
    from pretuner.sweep import where

    command = _command("run")
    params = _long_names(command)
    for key in t.options:
        if key not in params or key in NOT_PER_TUNING:
            close = difflib.get_close_matches(key, [k for k in params if k not in NOT_PER_TUNING])
            raise BadInputError(
                f"{where(file, t.lines.get(key))}: tuning {t.name!r}: unknown key {key!r}",
                hint=f"did you mean {' or '.join(close)}?" if close
                else "a key is a `run` option by its long name (`pretuner run --help`)")
    try:
        command.make_context("run", t.args(_flags(params)), resilient_parsing=False)
    except typer.Exit:
        pass
    except Exception as err:  # click's usage errors (typer may carry its own click)
        param = getattr(err, "param", None)
        key = next((k for k in t.options if param is not None and params[k] is param), "")
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        raise BadInputError(f"{where(file, t.lines.get(key, t.line))}: tuning "
                            f"{t.name!r}: {message.rstrip('.')}",
                            hint="the values `pretuner run --help` takes") from None


def plan_tunings(tunings: list[Tuning], file: Path, on_ray: bool) -> list[Planned]:
    """Each tuning's command line; on Ray also the devices its layout holds (`pretuner plan`
    of its options, all at once)."""
    from pretuner.sweep import Planned, device_of

    params = _long_names(_command("run"))
    runs = [t.args(_flags(params)) for t in tunings]
    if not on_ray:
        return [Planned(t, args, "CPU", 1) for t, args in zip(tunings, runs, strict=True)]
    plan_flags = _flags(_long_names(_command("plan")))
    for t in tunings:
        if t.engine == "auto":
            raise BadInputError(f"{file}:{t.line}: tuning {t.name!r} has no engine",
                                hint="on Ray, name each tuning's engine (its devices: GPU, NPU)")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pretuner", "plan", *t.args(plan_flags), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        for t in tunings]  # fmt: skip
    planned = []
    for t, args, proc in zip(tunings, runs, procs, strict=True):
        out, _ = proc.communicate()
        doc = json.loads(out or "{}")
        # A layout plan refuses is the run's to refuse, with its record: one device asked.
        count = int(doc.get("tp", 1)) * int(doc.get("pp", 1)) if proc.returncode == 0 else 1
        planned.append(Planned(t, args, device_of(t.engine), count))
    return planned
