"""report.html: one self-contained page (inline CSS and SVG, no script, no URL) built from a run
folder's files only."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from pretuner.files import write_atomic
from pretuner.report_html.breakdown import breakdown, is_v1
from pretuner.report_html.charts import Bar, Chart, bar, chart
from pretuner.report_html.inputs import Decision, LaunchMemory, RunFiles, read_run

PAGE = "report.html"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Fact:
    label: str
    value: str


@dataclass(frozen=True, slots=True)
class LaunchView:
    n: int
    title: str
    chart: Chart | None


def _gib(value: Any) -> str:
    return f"{float(value):.2f} GiB" if isinstance(value, int | float) else "?"


def _int(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "?"


def headline(rep: dict[str, Any]) -> tuple[str, list[Fact]]:
    """The page's title line and the facts beneath it, r0.1 or V1."""
    title = f"{rep.get('model', '?')}, {_int(rep.get('launches'))} launch(es)"
    facts: list[Fact] = []
    final = rep.get("final") or {}
    if is_v1(rep):
        version = rep.get("engine_version")
        facts.append(Fact("engine", f"{rep.get('engine', '?')}"
                               + (f" {version}" if version else "")
                               + f" ({rep.get('method')})"))
        total = (rep.get("derivation") or {}).get("device_total_mib")
        facts.append(Fact("card", f"{rep.get('card_gib', '?')} GB {rep.get('device_kind', '')}"
                          + (f", {_int(total)} MiB" if total is not None else "")))
        if "kv_cache_memory_bytes" in final:
            facts.append(Fact("KV cache (pinned)",
                              f"--kv-cache-memory-bytes {final['kv_cache_memory_bytes']} "
                              f"({_gib(final.get('kv_cache_gib'))}) = "
                              f"{_int(final.get('kv_tokens'))} KV tokens"))
        shape = final
    else:
        facts.append(Fact("engine", f"vLLM-MindSpore r0.1, backend {rep.get('backend', '?')}"))
        facts.append(Fact("card", f"{rep.get('card_gib', '?')} GiB ({rep.get('card_source', '')})"))
        if "max_kv_gib" in rep:
            facts.append(Fact("KV cache per card", f"{_gib(rep['max_kv_gib'])} = "
                              f"{_int(rep.get('max_kv_tokens'))} tokens"))
        shape = final.get("flags") or {}
    facts.append(Fact("layout", f"TP{rep.get('tp', '?')} x PP{rep.get('pp', '?')}"))
    if "max_model_len" in shape:
        facts.append(Fact("shape", f"max_model_len {_int(shape['max_model_len'])}, "
                          f"max-num-seqs {_int(shape.get('max_num_seqs'))}"))
    return title, facts


def asked_lines(rep: dict[str, Any]) -> tuple[str | None, list[str]]:
    """What was asked and what was given up against it, when the report says (else nothing)."""
    asked = rep.get("asked")
    said = None
    if isinstance(asked, dict):
        seqs = asked.get("max_num_seqs")
        said = (f"asked: max_model_len {_int(asked.get('max_model_len'))}, max-num-seqs "
                + ("as many as fit" if seqs is None else _int(seqs)))
    given_up = rep.get("given_up")
    lines = [str(g) for g in given_up] if isinstance(given_up, list) else []
    return said, lines


def launch_caps(rep: dict[str, Any], mem: LaunchMemory) -> list[tuple[float, str, str]]:
    """The dashed lines of a launch's chart: the card, and r0.1's pool cap card x util."""
    caps: list[tuple[float, str, str]] = []
    card_gib = rep.get("card_gib")
    total = mem.total_mib
    if total is None and isinstance(card_gib, int | float) and not is_v1(rep):
        total = int(card_gib * 1024)
    if total is not None:
        caps.append((float(total), f"card total {total:,} MiB", "card"))
    steps = [s for s in rep.get("steps") or [] if isinstance(s, dict) and s.get("n") == mem.n]
    settings = (steps[0].get("settings") or {}) if steps else {}
    util = settings.get("util")
    if not is_v1(rep) and isinstance(util, int | float) and isinstance(card_gib, int | float):
        cap = card_gib * 1024 * util
        caps.append((cap, f"card x util {util:g} = {cap:,.0f} MiB", "util"))
    soak = rep.get("soak")
    if isinstance(soak, dict) and soak.get("launch") == mem.n:
        before, after = soak.get("before_mib"), soak.get("after_mib")
        if isinstance(before, int) and isinstance(after, int):
            caps.append((float(before), f"before the soak {before:,} MiB", "soak"))
            caps.append((float(after), f"after the soak {after:,} MiB ({after - before:+,} "
                         "MiB)", "soak"))
    return caps


def launch_title(rep: dict[str, Any], n: int) -> str:
    steps = [s for s in rep.get("steps") or [] if isinstance(s, dict) and s.get("n") == n]
    if not steps:
        return f"launch {n}"
    s = steps[0]
    return f"launch {n}: {s.get('purpose', '?')}, outcome {s.get('outcome', '?')}"


@dataclass(frozen=True, slots=True)
class Page:
    run: str
    title: str
    simulated: bool
    validated: bool
    error: str | None
    hint: str | None
    facts: tuple[Fact, ...]
    asked: str | None
    given_up: tuple[str, ...]
    bar: Bar | None
    legend: tuple[tuple[str, str], ...]  # (kind, label)
    total_label: str
    overrun: str | None
    launches: tuple[LaunchView, ...]
    decisions: tuple[Decision, ...]


def page_of(files: RunFiles) -> Page:
    """Everything the template shows, computed (pure but for nothing: `files` is read)."""
    rep = files.report
    title, facts = headline(rep)
    asked, given_up = asked_lines(rep)
    b = breakdown(rep)
    launches = tuple(LaunchView(m.n, launch_title(rep, m.n), chart(m, launch_caps(rep, m)))
                     for m in files.memory)
    return Page(
        run=str(rep.get("run_id") or files.folder.name),
        title=title,
        simulated=rep.get("simulated") is True,
        validated=rep.get("validated") is True,
        error=str(rep["error"]).partition("\n")[0] if rep.get("error") else None,
        hint=str(rep["hint"]) if rep.get("hint") else None,
        facts=tuple(facts),
        asked=asked,
        given_up=tuple(given_up),
        bar=bar(b) if b is not None else None,
        legend=tuple((s.kind, f"{s.label}: {s.gib:.2f} GiB = {s.mib:,.1f} MiB ({s.provenance})")
                     for s in b.segments) if b is not None else (),
        total_label=b.total_label if b is not None else "",
        overrun=(f"the parts exceed the card by {b.overrun_mib:,.0f} MiB"
                 if b is not None and b.overrun_mib > 0 else None),
        launches=launches,
        decisions=files.decisions,
    )


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("pretuner.report_html", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=True,  # every value is text from the run: escaped
        keep_trailing_newline=True,
    )


def render_html(run_dir: Path) -> str:
    """The page for the run in `run_dir`, from its files only."""
    return _env().get_template("report.html.j2").render(page=page_of(read_run(Path(run_dir))))


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
