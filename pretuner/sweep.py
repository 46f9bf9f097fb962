"""`pretuner sweep`: many tunings, each one `pretuner run` with its own run folder, one after
another here or as Ray tasks on the nodes with free devices; then one summary and presets.

Each tuning runs as a child process (`python -m pretuner run ... --out SWEEP/NAME --json`): its
folder is a normal run folder (`report`, `script`, `run --resume` work on it), and a tuning that
crashes cannot take the others with it.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from pretuner.engines.mindspore_r01 import R01Engine
from pretuner.engines.vllm_v1 import RAY_RESOURCE, ROWS, card_unit
from pretuner.errors import BadInputError, ExitCode
from pretuner.files import write_atomic
from pretuner.procgroups import stop_group
from pretuner.tune.record import JOURNAL, RunRecord
from pretuner.units import MIB

log = logging.getLogger(__name__)

NAME_PATTERN = r"^[a-z0-9][a-z0-9.-]*$"  # a folder name and a shell word, as a preset's
STOP_GRACE_S = 180.0  # a tuning told to stop stops its server first (its own --stop-grace)
Scalar = str | int | float | bool


class Entry(BaseModel):
    """One tuning of the file: `model` and any `run` option by its long name (checked by the
    command, which knows them)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str | None = Field(None, pattern=NAME_PATTERN)
    model: str = Field(min_length=1)
    engine: str = "auto"
    emulate: StrictBool = False


class _Options(BaseModel):
    """The other options' values: scalars, or a list of them for a repeatable option."""

    model_config = ConfigDict(frozen=True)
    values: dict[str, Scalar | list[Scalar]]


@dataclass(frozen=True, slots=True)
class Tuning:
    """One tuning: `pretuner run ARGS` into the folder NAME of the sweep."""

    name: str
    model: str
    engine: str
    options: dict[str, Scalar | list[Scalar]]  # every key of the entry but `name`
    line: int  # the entry's line in the file
    lines: dict[str, int]  # each key's line

    def args(self, flags: Callable[[str, Scalar], list[str]]) -> list[str]:
        """The command line of these options, each through `flags(key, value)`."""
        out: list[str] = []
        for key, value in self.options.items():
            for one in value if isinstance(value, list) else [value]:
                out += flags(key, one)
        return out


def where(path: Path, line: int | None) -> str:
    return f"{path}:{line}" if line else str(path)


def read_sweep(path: Path) -> list[Tuning]:
    """The tunings of a sweep file; BadInputError naming the file's line on a bad entry."""
    try:
        text = Path(path).read_text()
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise BadInputError(f"{where(path, mark.line + 1 if mark else None)}: not YAML: "
                            f"{getattr(err, 'problem', None) or err}",
                            hint="see `pretuner sweep --help` for the format") from None
    if not isinstance(data, list) or not data or not isinstance(root, yaml.SequenceNode):
        raise BadInputError(f"{path}: a sweep file is a list of tunings",
                            hint="e.g. `- {model: qwen3-8b, card: 80, engine: vllm}`")
    tunings: list[Tuning] = []
    for node, entry in zip(root.value, data, strict=True):
        line = node.start_mark.line + 1
        if not isinstance(entry, dict) or not isinstance(node, yaml.MappingNode):
            raise BadInputError(f"{where(path, line)}: a tuning is a mapping of run options",
                                hint="e.g. `- {model: qwen3-8b, card: 80, engine: vllm}`")
        lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value}
        try:
            e = Entry.model_validate(entry)
            extra = _Options.model_validate({"values": e.model_extra or {}}).values
        except ValidationError as err:
            first = err.errors()[0]
            loc = [str(p) for p in first["loc"] if p != "values"]
            key = loc[0] if loc else ""
            raise BadInputError(
                f"{where(path, lines.get(key, line))}: {key or 'tuning'}: {first['msg']} "
                f"(given {first.get('input')!r})",
                hint="a value is a number, a word, true/false, or a list of them") from None
        switch: dict[str, Scalar | list[Scalar]] = {"emulate": True} if e.emulate else {}
        options = {"model": e.model, "engine": e.engine, **switch, **extra}
        model = "".join(c if c.isalnum() or c in ".-" else "-" for c in Path(e.model).name.lower())
        name = e.name or f"{len(tunings) + 1:02d}-{model}-{e.engine}"
        if name in {t.name for t in tunings}:
            raise BadInputError(f"{where(path, lines.get('name', line))}: a second tuning "
                                f"named {name!r}", hint="give each tuning its own `name`")
        tunings.append(Tuning(name, e.model, e.engine, options, line, lines))
    return tunings


def device_of(engine: str) -> str:
    """The Ray resource a tuning of this engine holds its cards as: GPU, NPU or CPU."""
    row = ROWS.get(engine)
    return RAY_RESOURCE[row.device if row else R01Engine(engine, False, None, "").device]


# --- one tuning (here, or inside a Ray task on a node) ---------------------------------------

def run_one(args: Sequence[str], folder: str) -> dict[str, Any]:
    """`pretuner run ARGS --out FOLDER --json` (or `--resume FOLDER` when it holds an unfinished
    run) as its own process group; Ctrl-C (or a Ray cancel) stops it, and its server, first."""
    out = Path(folder)
    errors = out.parent / f".{out.name}.stderr"
    t0 = time.monotonic()
    record = RunRecord.open(out) if (out / JOURNAL).is_file() else None
    finished = next(record.of_kind("run_finished"), None) if record is not None else None
    code = None if finished is not None else _run_process(
        ["--resume", str(out)] if record is not None else [*args, "--out", str(out)], errors)
    report = _read_json(out / "report.json")
    if record is not None and finished is not None:
        # It ended before a stop reached this sweep (--resume would refuse it): as it ended.
        options = next(record.of_kind("run_started"), {}).get("options")
        code = int(ExitCode.of_finished_run(
            bool(finished.get("validated")),
            not isinstance(options, dict) or options.get("validate", True) is not False,
            bool((report or {}).get("given_up"))))
    return {"exit_code": code, "reason": None if code == 0 else _reason(report, errors),
            "report": report, "seconds": round(time.monotonic() - t0, 1),
            "host": socket.gethostname()}


def _run_process(argv: list[str], errors: Path) -> int:
    """`pretuner run ARGV --json` in its own process group, its stderr added to `errors`."""
    errors.parent.mkdir(parents=True, exist_ok=True)
    with open(errors, "a") as err:  # a resumed tuning adds to its earlier lines
        proc = subprocess.Popen([sys.executable, "-m", "pretuner", "run", *argv, "--json"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            # Polled: a Ray cancel raises KeyboardInterrupt between bytecodes, never inside
            # a blocking wait.
            while (code := proc.poll()) is None:
                time.sleep(0.2)
        except BaseException:  # Ctrl-C, SIGTERM, a Ray cancel: the run stops its server first
            stop_group(proc.pid, STOP_GRACE_S, reap=proc.poll)
            raise
    return code


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _reason(report: dict[str, Any] | None, errors: Path) -> str:
    """The failure in one line: the failure report's, else the run's last error line."""
    if report is not None and report.get("error"):
        return str(report["error"]).partition("\n")[0]
    if report is not None and not report.get("validated"):
        return "not validated under full load"
    if report is not None and report.get("given_up"):
        return "validated, but less than asked (report.md: what was given up)"
    text = errors.read_text(errors="replace") if errors.is_file() else ""
    lines = [x for x in text.splitlines() if x.strip()]
    said = [x for x in lines if x.startswith("pretuner: ")]
    last = (said or lines or ["no output"])[-1]
    return last.removeprefix("pretuner: ").removeprefix("error: ").strip()


def run_task(args: Sequence[str], folder: str) -> Iterator[dict[str, Any]]:
    """The Ray task: says where it started, then runs the tuning there."""
    yield {"host": socket.gethostname()}
    yield run_one(args, folder)


# --- the sweep --------------------------------------------------------------------------------

Say = Callable[[str, str, str], None]  # (event, tuning name, detail)


@dataclass(frozen=True, slots=True)
class Planned:
    """A tuning with its command line and what it holds while it runs."""

    tuning: Tuning
    args: list[str]
    device: str  # GPU, NPU or CPU
    count: int  # devices of the layout (TP x PP)


def finished(folder: Path) -> dict[str, Any] | None:
    """What an earlier session of the sweep recorded for a tuning that ended (not interrupted)."""
    result = _read_json(folder.parent / f".{folder.name}.result.json")
    if result is None or result.get("exit_code") == ExitCode.INTERRUPTED:
        return None
    return result


Results = dict[str, dict[str, Any]]  # tuning name -> how it ended (filled as they end)


def _end(name: str, result: dict[str, Any], sweep_dir: Path, say: Say, results: Results) -> None:
    """Keep how a tuning ended, for this summary and a later --resume (`finished`)."""
    write_atomic(sweep_dir / f".{name}.result.json", json.dumps(result) + "\n", overwrite=True)
    results[name] = result
    say("finish", name, _finish_words(result))


def run_here(plans: Sequence[Planned], sweep_dir: Path, say: Say, results: Results) -> None:
    """One after another on this machine."""
    for p in plans:
        say("start", p.tuning.name, "here")
        _end(p.tuning.name, run_one(p.args, str(sweep_dir / p.tuning.name)), sweep_dir, say,
             results)


def run_on_ray(address: str, plans: Sequence[Planned], sweep_dir: Path, say: Say,
               results: Results) -> None:
    """Every tuning a Ray task holding its devices: as many at once as the free devices allow."""
    from pretuner.cluster.ray_api import RayCluster

    cluster = RayCluster.connect(address)
    running: dict[Any, Planned] = {}

    def end(p: Planned, result: dict[str, Any]) -> None:
        _end(p.tuning.name, result, sweep_dir, say, results)

    def step(stopping: bool) -> None:
        """Take the next item of every task that has one: its start, or its end."""
        for gen in cluster.wait_any(list(running)):
            item = cluster.next_of(gen)
            if isinstance(item, dict) and "exit_code" not in item:
                say("start", running[gen].tuning.name, f"on {item['host']}")
                continue
            p = running.pop(gen)
            if isinstance(item, str) and not stopping:  # died without its result (its node)
                end(p, {"exit_code": int(ExitCode.INTERNAL), "seconds": 0.0, "report": None,
                        "reason": item})
            elif isinstance(item, dict) and item["exit_code"] != ExitCode.INTERRUPTED:
                end(p, item)  # it ended before the stop reached it

    try:
        for p in plans:
            most = cluster.largest(p.device)
            if p.count > most:
                end(p, {"exit_code": int(ExitCode.CLUSTER), "seconds": 0.0, "report": None,
                        "reason": f"needs {p.count} {p.device} on one node; the largest node "
                                  f"of the Ray cluster has {most}"})
                continue
            gen = cluster.submit_holding(run_task, p.device, p.count, p.args,
                                         str(sweep_dir / p.tuning.name))
            running[gen] = p
            say("queued", p.tuning.name, f"needs {p.count} {p.device}")
        while running:
            step(stopping=False)
    except KeyboardInterrupt:
        say("stop", "sweep", f"stopping {len(running)} tuning(s), each stops its server first")
        cluster.cancel(list(running))
        deadline = time.monotonic() + STOP_GRACE_S
        while running and time.monotonic() < deadline:
            step(stopping=True)
        raise
    finally:
        cluster.close()


def _finish_words(result: dict[str, Any]) -> str:
    code = result["exit_code"]
    words = "validated" if code == 0 else f"exit {code}: {result['reason']}"
    return f"{words} ({result['seconds']:.1f} s)"


# --- the summary ------------------------------------------------------------------------------

def outcome_of(code: int) -> str:
    return {0: "validated", int(ExitCode.LESS_THAN_ASKED): "less than asked",
            int(ExitCode.NOT_VALIDATED): "not validated",
            int(ExitCode.INTERRUPTED): "interrupted"}.get(code, "failed")


def summary_row(t: Tuning, folder: Path, result: dict[str, Any] | None) -> dict[str, Any]:
    """One row: the tuning, how it ended, and its report's figures (None where it has none)."""
    rep = (result or {}).get("report") or {}
    final = rep.get("final") or {}
    pinned = (rep.get("derivation") or {}).get("kv_cache_memory_bytes")
    kv_gib = final.get("kv_gib")
    code = None if result is None else result["exit_code"]
    started = (folder / "journal.jsonl").exists()
    return {
        "name": t.name, "model": t.model, "card_gib": rep.get("card_gib", t.options.get("card")),
        "engine": rep.get("engine", t.engine),
        "outcome": ("interrupted" if started else "not run") if code is None
                   else outcome_of(code),
        "exit_code": code,
        "reason": None if result is None else result.get("reason"),
        "kv_mib": (pinned // MIB if pinned is not None
                   else round(kv_gib * 1024) if kv_gib is not None else None),
        "kv_pinned": pinned is not None,
        "max_model_len": final.get("max_model_len"), "max_num_seqs": final.get("max_num_seqs"),
        "proven": bool(rep.get("validated")), "provenance": rep.get("provenance"),
        "seconds": None if result is None else result.get("seconds"),
        "run_folder": str(folder) if started else None,
    }


def summary_markdown(rows: Sequence[dict[str, Any]], presets: dict[str, str]) -> str:
    """summary.md: one row per tuning, then the presets written."""
    head = ("tuning", "model", "card", "engine", "outcome", "KV per device (MiB, derived)",
            "max-model-len", "max-num-seqs", "proven", "figures", "run folder")
    lines = ["# Sweep summary", "", f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for r in rows:
        outcome = r["outcome"] + (f" (exit {r['exit_code']}: {r['reason']})" if r["reason"] else "")
        kv = "" if r["kv_mib"] is None else f"{r['kv_mib']:,}" + ("" if r["kv_pinned"]
                                                                 else " (r0.1 budget)")
        card = "" if r["card_gib"] is None else f"{r['card_gib']} {card_unit(r['engine'])}"
        cells = [r["name"], r["model"], card,
                 r["engine"], outcome.replace("|", "/"), kv,
                 "" if r["max_model_len"] is None else f"{r['max_model_len']:,}",
                 "" if r["max_num_seqs"] is None else r["max_num_seqs"],
                 "yes" if r["proven"] else "no", r["provenance"] or "",
                 r["run_folder"] or ("(none: refused before a run folder)"
                                     if r["exit_code"] else "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if presets:
        lines += ["", "Presets of the validated tunings (`pretuner presets show FILE`, "
                  "`pretuner script --preset FILE`):", ""]
        lines += [f"- {name}: {file}" for name, file in presets.items()]
    return "\n".join(lines) + "\n"


def write_presets(results: Results, sweep_dir: Path) -> dict[str, str]:
    """A presets catalog entry (`presets add`'s file) per validated tuning, in SWEEP/presets."""
    from pretuner.presets.model import check_preset, preset_from_report, preset_to_json
    from pretuner.report.records import RunReport

    out: dict[str, str] = {}
    for name, result in results.items():
        rep = result.get("report")
        if result["exit_code"] not in (0, ExitCode.LESS_THAN_ASKED) or not rep:
            continue
        run = RunReport.model_validate(rep)
        p = preset_from_report(run, date=datetime.date.today().isoformat())  # names its run
        if problems := check_preset(p):
            log.warning("tuning %s: no preset, its record disagrees with the KV math: %s",
                        name, problems[0])
            continue
        folder = sweep_dir / "presets"
        folder.mkdir(exist_ok=True)
        path = write_atomic(folder / f"{p.name}.json",
                            json.dumps(preset_to_json(p), indent=2) + "\n", overwrite=True)
        out[p.name] = str(path)
    return out


def write_summary(tunings: Sequence[Tuning], results: Results,
                  sweep_dir: Path) -> dict[str, Any]:
    """summary.md and summary.json in the sweep folder; returns summary.json's object."""
    rows = [summary_row(t, sweep_dir / t.name, results.get(t.name)) for t in tunings]
    presets = write_presets(results, sweep_dir)
    ok = all(r["exit_code"] == 0 for r in rows)
    doc = {"sweep_dir": str(sweep_dir), "tunings": rows, "presets": presets,
           "validated": sum(r["exit_code"] == 0 for r in rows),
           "exit_code": int(ExitCode.OK if ok else ExitCode.SWEEP_INCOMPLETE)}
    write_atomic(sweep_dir / "summary.json", json.dumps(doc, indent=2) + "\n", overwrite=True)
    write_atomic(sweep_dir / "summary.md", summary_markdown(rows, presets), overwrite=True)
    return doc
