"""report.html: one self-contained page (inline CSS and SVG, no script, no URL) built from a run
folder's files only: its record (report.json) and each launch's `memory.tsv`."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from pretuner.devices.series import LaunchMemory, parse_memory_tsv
from pretuner.files import MAX_INPUT_BYTES, read_bounded, write_atomic
from pretuner.report.html.breakdown import breakdown
from pretuner.report.html.charts import Bar, Chart, bar, chart
from pretuner.report.records import (
    AnyReport,
    FailureReport,
    PinnedDerivation,
    RunReport,
    Step,
    boots_words,
    decision_text,
    device_words,
    kv_words,
    read_report,
)

PAGE = "report.html"
log = logging.getLogger(__name__)
_LAUNCH_DIR = re.compile(r"^launch-(\d+)$")  # not `launch-3.interrupted-1`: a dead attempt


@dataclass(frozen=True, slots=True)
class LaunchView:
    n: int
    title: str
    chart: Chart | None
    soak: str | None = None  # the soak's growth rate and time to exhaustion (its launch)


def launch_memory(folder: Path) -> tuple[LaunchMemory, ...]:
    """Each launch's memory.tsv, in launch order."""
    launches = sorted(
        (int(m.group(1)), d)
        for d in folder.iterdir()
        if d.is_dir() and (m := _LAUNCH_DIR.match(d.name)) is not None
    )
    # A day of samples every 20 ms stays under the bound; a damaged byte is only a bad row.
    return tuple(
        parse_memory_tsv(n, read_bounded(d / "memory.tsv", 256 * MAX_INPUT_BYTES).decode(
            "utf-8", errors="replace"))
        for n, d in launches
        if (d / "memory.tsv").is_file()
    )


def _step(rep: AnyReport, n: int) -> Step | None:
    return next((s for s in rep.steps if s.n == n), None)


def launch_caps(rep: AnyReport, mem: LaunchMemory) -> list[tuple[float, str, str]]:
    """The dashed lines of a launch's chart: the card, r0.1's pool cap card x util, the soak."""
    caps: list[tuple[float, str, str]] = []
    s = _step(rep, mem.n)
    pool = s is not None and s.settings.model_use_gib > 0  # r0.1: a pool capped at card x util
    total = mem.total_mib if mem.total_mib is not None or not pool else rep.card_gib * 1024
    if total is not None:
        caps.append((float(total), f"card total {total:,} MiB", "card"))
    if pool and s is not None:
        util = s.settings.util
        cap = rep.card_gib * 1024 * util
        caps.append((cap, f"card x util {util:g} = {cap:,.0f} MiB", "util"))
    d = rep.derivation if isinstance(rep, RunReport) else None
    soak = d.soak if isinstance(d, PinnedDerivation) else None
    if soak is not None and soak.launch == mem.n:
        before, after = soak.before_mib, soak.after_mib
        caps.append((float(before), f"before the soak {before:,} MiB", "soak"))
        caps.append((float(after), f"after the soak {after:,} MiB ({after - before:+,} MiB)",
                     "soak"))
    return caps


@dataclass(frozen=True, slots=True)
class Page:
    run: str
    title: str
    simulated: bool
    validated: bool
    error: str | None
    hint: str | None
    facts: tuple[tuple[str, str], ...]  # (label, value)
    asked: str | None
    given_up: tuple[str, ...]
    bar: Bar | None
    legend: tuple[tuple[str, str], ...]  # (kind, label)
    total_label: str
    overrun: str | None
    launches: tuple[LaunchView, ...]
    # (decision, text): the record's, as report.md lists them; not the journal's, where a resumed
    # run has its interrupted attempt's decisions twice
    decisions: tuple[tuple[str, str], ...]


def page_of(folder: Path) -> Page:
    """Everything the template shows, from the run folder's files only (raises BadInputError
    when it has no readable report.json)."""
    rep = read_report(folder)
    done = rep if isinstance(rep, RunReport) else None  # a failed run has no configuration
    failed = rep if isinstance(rep, FailureReport) else None
    version = f" {rep.engine_version}" if rep.engine_version else ""
    facts = [("engine", f"{rep.engine}{version} ({rep.engine_reason})"),
             ("card", device_words(rep))]
    if done is not None:
        facts.append(("KV cache per card", kv_words(done)))
        if (boots := boots_words(done)) is not None:
            facts.append(("boot spread", boots))
    if done is not None and (p := done.peak) is not None:
        facts.append(("peak set by", f"{p.what}: {p.peak_mib:,} MiB ({rep.provenance}), "
                      f"launch {p.launch}"))
    facts.append(("layout", f"TP{rep.tp} x PP{rep.pp} on {rep.nodes} node(s)"))
    asked = None
    if done is not None:
        facts.append(("shape", f"max_model_len {done.final.max_model_len:,}, "
                      f"max-num-seqs {done.final.max_num_seqs}"))
        seqs = done.asked.max_num_seqs
        asked = (f"asked: max_model_len {done.asked.max_model_len:,}, max-num-seqs "
                 + ("as many as fit" if seqs is None else f"{seqs:,}"))
    b = breakdown(rep)
    launches = []
    d = rep.derivation if isinstance(rep, RunReport) else None
    soak = d.soak if isinstance(d, PinnedDerivation) else None
    for m in launch_memory(folder):
        step = _step(rep, m.n)
        title = f"launch {m.n}" + ("" if step is None else
                                   f": {step.purpose}, outcome {step.outcome}")
        rate = soak.rate_line(rep.provenance) if soak is not None and soak.launch == m.n else None
        launches.append(LaunchView(m.n, title, chart(m, launch_caps(rep, m)), rate))
    return Page(
        run=rep.run_id or folder.name,
        title=f"{rep.model}, {rep.launches:,} launch(es)",
        simulated=rep.simulated,
        validated=rep.validated,
        error=failed.error.partition("\n")[0] if failed is not None else None,
        hint=failed.hint if failed is not None else None,
        facts=tuple(facts),
        asked=asked,
        given_up=tuple(done.given_up) if done is not None else (),
        bar=bar(b) if b is not None else None,
        legend=tuple((s.kind, f"{s.label}: {s.gib:.2f} GiB = {s.mib:,.1f} MiB ({s.provenance})")
                     for s in b.segments) if b is not None else (),
        total_label=b.total_label if b is not None else "",
        overrun=(f"the parts exceed the card by {b.overrun_mib:,.0f} MiB"
                 if b is not None and b.overrun_mib > 0 else None),
        launches=tuple(launches),
        decisions=tuple((str(d.get("decision", "?")), decision_text(d)) for d in rep.decisions),
    )


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("pretuner.report.html", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=True,  # every value is text from the run: escaped
        keep_trailing_newline=True,
    )


def render_html(run_dir: Path) -> str:
    """The page for the run in `run_dir`, from its files only."""
    return _env().get_template("report.html.j2").render(page=page_of(Path(run_dir)))


def refresh_run_page(run_dir: Path) -> Path | None:
    """`run`'s own report.html, rewritten with the run's files; a page that cannot be made is
    logged, never the run's failure (report.md and report.json say everything it shows)."""
    try:
        return write_html(run_dir, overwrite=True)
    except Exception as err:  # any rendering or writing problem: the run's result stands
        log.warning("could not write %s/%s: %s: %s", run_dir, PAGE, type(err).__name__, err)
        return None


def write_html(run_dir: Path, out: Path | None = None, *, overwrite: bool = False) -> Path:
    """Write the page (atomically) to `out`, default `run_dir/report.html`; an existing file
    is refused unless `overwrite`."""
    target = Path(out) if out is not None else Path(run_dir) / PAGE
    return write_atomic(target, render_html(run_dir), overwrite=overwrite)
