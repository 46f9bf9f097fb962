"""report.html: the pure parts (the breakdown sums to the card, the page escapes and links
nothing), then real r0.1 and V1 runs rendered and opened in a real headless browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pretuner.devices.series import LaunchMemory, MemoryRow
from pretuner.report.html.breakdown import breakdown, breakdown_r01, breakdown_v1
from pretuner.report.html.charts import bar, chart
from pretuner.report.html.page import render_html
from pretuner.report.records import (
    Asked,
    FailureReport,
    Method,
    PinnedDerivation,
    R01Derivation,
    RunReport,
    V1Memory,
    V1Soak,
    device_words,
    read_report,
)
from tests.helpers import R01_QWEN_64, V1_QWEN_80_32K, FinishedRun, invoke

# An attribute that loads something from elsewhere: a URL with a scheme or `//host`.
EXTERNAL = re.compile(r"""(?:src|href|xlink:href|action)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:|//)""",
                      re.IGNORECASE)


GOLDEN_RUN = Path(__file__).parent / "golden" / "run"  # an r0.1 report.json of schema 1
H200 = Path(__file__).parent / "fixtures" / "real" / "vllm-0.24-h200" / "run8k"


def r01_report(**extra: object) -> RunReport:
    base = read_report(GOLDEN_RUN)
    assert isinstance(base, RunReport)
    assert isinstance(base.derivation, R01Derivation)
    return base.model_copy(update={
        "run_id": "r", "final": base.final.model_copy(update={"kv_gib": 39.9485,
                                                              "kv_tokens": 290896}),
        "derivation": base.derivation.model_copy(update={
            "weights_act_gib": 19.2063, "headroom_total_gib": 0.2248,
            "rounding_cost_gib": 0.5689, "util": 0.9367}),
    } | extra)


def v1_report(pinned: dict[str, object] | None = None, **extra: object) -> RunReport:
    """A V1 run's record; `pinned` changes its derivation."""
    base = read_report(H200)
    assert isinstance(base, RunReport)
    assert isinstance(base.derivation, PinnedDerivation)
    d = base.derivation
    assert d.budget is not None
    budget = d.budget.model_copy(update={"device_total_mib": 81559, "non_kv_peak_mib": 20034.8,
                                         "margin_mib": 408})
    return base.model_copy(update={
        "run_id": "v", "card_gib": 80, "simulated": True, "provenance": "simulated",
        "final": base.final.model_copy(update={"kv_gib": 59.684, "kv_tokens": 434592,
                                               "max_model_len": 32768}),
        "derivation": d.model_copy(update={"kv_cache_memory_bytes": 64084770816,
                                           "budget": budget} | (pinned or {})),
    } | extra)


def pinned(rep: RunReport) -> PinnedDerivation:
    assert isinstance(rep.derivation, PinnedDerivation)
    return rep.derivation


def failed(rep: RunReport, method: Method) -> FailureReport:
    """`rep`'s run as if a server failure had stopped it."""
    head = rep.model_dump(exclude={"final", "derivation", "asked", "given_up", "peak"})
    return FailureReport(**head, method=method, error="boom", hint=None, exit_code=5,
                         error_type="ServerFailedError", server_log=None)


def test_the_card_is_said_in_its_methods_unit() -> None:
    # r0.1's --card is the card's GiB (ASCEND_TOTAL_MEMORY_GB), a V1 engine's the device's GB;
    # a failed run, which has no derivation, says it as a finished one of its method does.
    r01, v1 = r01_report(), v1_report()
    assert device_words(r01) == "64 GiB card(s) (emulated npu-smi)"
    assert device_words(failed(r01, "r0.1")) == "64 GiB card(s) (emulated npu-smi)"
    assert device_words(v1) == "80 GB device(s)"
    assert device_words(failed(v1, "v1-pinned-kv")) == "80 GB device(s)"
    real = v1.model_copy(update={"simulated": False})
    assert device_words(real) == "81,559 MiB device(s) (measured)"
    # An emulated CUDA card is said by its name and size (`card_source`), finished or failed.
    named = v1.model_copy(update={"card_source": "emulated H200 141 GB", "card_gib": 141})
    assert device_words(named) == "emulated H200 141 GB device(s)"
    assert device_words(failed(named, "v1-pinned-kv")) == "emulated H200 141 GB device(s)"
    assert device_words(failed(real, "v1-pinned-kv")) == "80 GB device(s)"  # nothing measured
    cpu = v1.model_copy(update={"device_kind": "cpu"})
    for rep in (cpu, failed(cpu, "v1-pinned-kv")):
        assert device_words(rep).startswith("a 80 GiB memory budget (RLIMIT_DATA")


def test_r01_breakdown_sums_to_the_card() -> None:
    rep = r01_report()
    assert isinstance(rep.derivation, R01Derivation)
    b = breakdown_r01(rep, rep.derivation)
    assert b.total_mib == 64 * 1024
    assert sum(s.mib for s in b.segments) == pytest.approx(b.total_mib)
    kinds = [s.kind for s in b.segments]
    assert kinds == ["weights", "headroom", "rounding", "kv", "free"]
    # The pool (everything but the remainder) is card x util.
    assert sum(s.mib for s in b.segments[:-1]) == pytest.approx(64 * 1024 * 0.9367, abs=1)


def test_v1_breakdown_sums_to_the_device() -> None:
    rep = v1_report()
    b = breakdown_v1(rep, pinned(rep))
    assert b is not None
    assert b.total_mib == 81559
    assert sum(s.mib for s in b.segments) == pytest.approx(81559)
    assert b.segments[1].mib == pytest.approx(61116)  # the pinned KV, from its bytes
    assert 0 <= b.segments[-1].mib < 1  # the KV rounded down to a MiB


def test_v1_breakdown_of_a_soaked_final_configuration() -> None:
    memory = V1Memory(launch=4, device_total_mib=65536, kv_held_mib=47337.8,
                      non_kv_peak_mib=16084.2, soak_growth_mib=1458, held_back_mib=442,
                      pinned_kv_mib=47338.0, free_mib=213.8, lines=[])
    rep = v1_report({"memory": memory})
    b = breakdown_v1(rep, pinned(rep))
    assert b is not None
    assert [s.kind for s in b.segments] == ["weights", "growth", "margin", "kv", "free"]
    assert sum(s.mib for s in b.segments) == pytest.approx(65536)
    assert b.segments[-1].mib == pytest.approx(memory.free_mib)  # report.json's remainder
    assert "launch 4" in b.total_label


def test_soak_phases_are_tinted_and_its_levels_drawn(tmp_path: Path) -> None:
    phases = ["load", "images", "soak-1", "soak-2", "reset", "after-soak"]
    tsv = "# launch 1\nt_s\tphase\tdevice\tused_mib\n" + "".join(
        f"{t / 10}\t{p}\t0\t{60000 + 200 * t}\n" for t, p in enumerate(phases))
    soak = V1Soak(launch=1, requests_asked=20, minutes_asked=None, requests=20,
                  before_mib=60200, half_mib=60400, after_mib=60600, after_reset_mib=None,
                  reset_status=None, growth_mib=400, reset_gave_back_mib=None,
                  second_half_mib=200, held_back_mib=400, peak_before_mib=60200,
                  peak_after_mib=60600)
    html = render_html(write_run(tmp_path / "run", v1_report({"soak": soak}), tsv))
    assert html.count('class="band soak"') == 4
    assert "after the soak 60,600 MiB (+400 MiB)" in html
    assert "before the soak 60,200 MiB" in html


def test_a_failed_run_has_no_breakdown() -> None:
    rep = r01_report()
    head = {k: v for k, v in rep if k in FailureReport.model_fields}
    failed = FailureReport(**head, method="r0.1", error="x", hint=None, exit_code=4,
                           error_type="InfeasibleError", server_log=None)
    assert breakdown(failed) is None
    assert breakdown(v1_report({"budget": None})) is None  # no device sampled


@given(total=st.floats(1, 1e6), parts=st.lists(st.floats(0, 1e5), min_size=1, max_size=5))
def test_segments_always_sum_to_the_card_or_say_the_overrun(total: float,
                                                            parts: list[float]) -> None:
    rep = v1_report()
    d = pinned(rep)
    assert d.budget is not None
    budget = d.budget.model_copy(update={"device_total_mib": total, "non_kv_peak_mib": parts[0],
                                         "margin_mib": sum(parts[1:])})
    b = breakdown_v1(rep, d.model_copy(update={"kv_cache_memory_bytes": 0, "budget": budget}))
    assert b is not None
    assert all(s.mib >= 0 for s in b.segments)
    assert sum(s.mib for s in b.segments) == pytest.approx(total + b.overrun_mib)
    drawn = bar(b)
    assert sum(r.width for r in drawn.rects) == pytest.approx(
        drawn.width * (1 + b.overrun_mib / total), abs=0.1)


def test_chart_marks_phases_devices_and_caps() -> None:
    rows = tuple(MemoryRow(t / 10, phase, dev, 1000 * t + dev)
                 for t, phase in enumerate(["launch", "loading", "loading", "load", "stop"])
                 for dev in (0, 1))
    c = chart(LaunchMemory(2, 8000, "fake", rows), [(8000.0, "card total", "card")])
    assert c is not None
    assert [b.label for b in c.bands] == ["launch", "loading", "load", "stop"]
    assert [line.label for line in c.lines] == ["device 0", "device 1"]
    assert len(c.lines[0].points.split()) == 5
    assert c.caps[0].y < min(float(p.split(",")[1]) for p in c.lines[1].points.split())
    assert chart(LaunchMemory(1, None, None, ()), []) is None


DECISION = {"decision": "derive", "reason": "<b>19 GiB</b> & more"}


def write_run(folder: Path, rep: RunReport, tsv: str | None = None) -> Path:
    folder.mkdir()
    rep = rep.model_copy(update={"decisions": [DECISION]})
    (folder / "report.json").write_text(json.dumps(rep.model_dump(mode="json")))
    # A resumed run's journal: the interrupted attempt's decision, then the same one made again.
    (folder / "journal.jsonl").write_text(2 * (json.dumps({"event": "decision", **DECISION}) + "\n"))
    if tsv is not None:
        (folder / "launch-1").mkdir()
        (folder / "launch-1" / "memory.tsv").write_text(tsv)
    return folder


def test_page_escapes_and_shows_what_was_given_up(tmp_path: Path) -> None:
    base = r01_report()
    step = base.steps[1].model_copy(update={"n": 1, "settings": base.steps[1].settings.model_copy(
        update={"util": 0.9367})})
    rep = r01_report(model="<script>alert(1)</script>",
                     asked=Asked(max_model_len=16384, max_num_seqs=None),
                     given_up=["max_model_len 11,264 < 16,384 asked"], steps=[step])
    tsv = "# launch 1: read by fake; total_mib=65536\nt_s\tphase\tdevice\tused_mib\n" \
          "0.0\tlaunch\t0\t100\n1.0\tload\t0\t60000\n"
    html = render_html(write_run(tmp_path / "run", rep, tsv))
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("&lt;b&gt;19 GiB&lt;/b&gt; &amp; more") == 1  # the record's, not the journal's
    assert "asked: max_model_len 16,384" in html
    assert "max_model_len 11,264 &lt; 16,384 asked" in html
    assert "SIMULATED" in html
    assert "card x util 0.9367" in html  # the r0.1 pool cap on the chart
    assert not EXTERNAL.search(html)


def test_page_without_asked_or_samples(tmp_path: Path) -> None:
    html = render_html(write_run(tmp_path / "run", v1_report(simulated=False,
                                                             provenance="measured")))
    assert "given up" not in html
    assert "SIMULATED" not in html
    assert "No launch has a memory.tsv" in html


# --- real runs on the emulated card, rendered, opened in a headless browser ----------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def need_browser() -> str:
    if CHROMIUM is None:
        if os.environ.get("PRETUNER_BROWSER_REQUIRED") == "1":
            pytest.fail("chromium is not installed and PRETUNER_BROWSER_REQUIRED=1")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return CHROMIUM


def tuned(run: FinishedRun) -> Path:
    assert run.proc.returncode == 0, run.proc.stderr
    return run.folder


@pytest.fixture(scope="module")
def r01_run(finished_run: Callable[..., FinishedRun]) -> Path:
    return tuned(finished_run(*R01_QWEN_64))


@pytest.fixture(scope="module")
def v1_run(finished_run: Callable[..., FinishedRun]) -> Path:
    return tuned(finished_run(*V1_QWEN_80_32K))


def kv_in_report_md(run: Path) -> str:
    """The final KV GiB as report.md prints it."""
    md = (run / "report.md").read_text()
    m = re.search(r"(?:KV cache per card|kv-cache-memory-bytes)\D*?\d*\D*?([\d.]+ GiB)", md)
    assert m is not None, md[:800]
    return m.group(1)


def browse(html: Path, tmp_path: Path) -> tuple[bytes, str]:
    """The page's screenshot (PNG bytes) and its DOM, from a real headless chromium."""
    chromium = need_browser()
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600"]
    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--screenshot={shot}", html.resolve().as_uri()],
                   capture_output=True, timeout=120, check=True, stdin=subprocess.DEVNULL)
    dom = subprocess.run([*base, "--dump-dom", html.resolve().as_uri()], capture_output=True,
                         text=True, timeout=120, check=True, stdin=subprocess.DEVNULL).stdout
    return shot.read_bytes(), dom


def assert_not_blank(png: bytes) -> None:
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (1200, 1600)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None
    assert len(colours) > 50, "a blank or near-blank page"
    white = {rgb: count for count, rgb in colours}.get((255, 255, 255), 0)
    assert white < 0.95 * image.size[0] * image.size[1]


@pytest.mark.engine  # a real headless chromium
@pytest.mark.slow
@pytest.mark.parametrize("which", ["r01", "v1"])
def test_report_html_renders_in_a_real_browser(which: str, request: pytest.FixtureRequest,
                                               tmp_path: Path) -> None:
    run: Path = request.getfixturevalue(f"{which}_run")
    assert sorted(p.name for p in run.glob("launch-*/memory.tsv")) == ["memory.tsv"] * len(
        list(run.glob("launch-*/server.log")))
    proc = invoke("report", str(run), "--out", str(tmp_path / "page.html"))
    assert proc.returncode == 0, proc.stderr
    page = Path(proc.stdout.strip())
    assert page == tmp_path / "page.html"
    html = page.read_text()
    assert not EXTERNAL.search(html), EXTERNAL.search(html)
    assert "<script" not in html
    assert "url(" not in html
    assert "@import" not in html
    png, dom = browse(page, tmp_path)
    assert_not_blank(png)
    text = re.sub(r"\s+", " ", dom)
    assert kv_in_report_md(run) in text
    assert "VALIDATED" in text
    assert "SIMULATED" in text
    assert "qwen3-8b" in text
    assert "Memory over time" in text
    assert "launch 2" in text
    assert "<svg" in dom
    assert text.count("<polyline") == len(list(run.glob("launch-*/memory.tsv")))


@pytest.mark.slow
def test_report_command_writes_beside_the_run_once(r01_run: Path, tmp_path: Path) -> None:
    run = shutil.copytree(r01_run, tmp_path / "run", symlinks=True)  # it writes there
    target = run / "report.html"
    target.unlink(missing_ok=True)
    first = invoke("report", str(run))
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(target)
    assert target.is_file()
    again = invoke("report", str(run))
    assert again.returncode == 2
    assert "--overwrite" in again.stderr
    assert invoke("report", str(run), "--overwrite").returncode == 0
    missing = invoke("report", str(run / "nope"))
    assert missing.returncode == 2
    assert "report.json" in missing.stderr
