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

from pretuner.report_html import render_html
from pretuner.report_html.breakdown import breakdown, breakdown_r01, breakdown_v1
from pretuner.report_html.charts import bar, chart
from pretuner.report_html.inputs import LaunchMemory, MemoryRow
from tests.helpers import R01_QWEN_64, V1_QWEN_80_32K, FinishedRun, invoke

# An attribute that loads something from elsewhere: a URL with a scheme or `//host`.
EXTERNAL = re.compile(r"""(?:src|href|xlink:href|action)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:|//)""",
                      re.IGNORECASE)


def r01_report(**extra: object) -> dict[str, object]:
    rep: dict[str, object] = {
        "run_id": "r", "model": "qwen3-8b", "card_gib": 64, "simulated": True, "validated": True,
        "launches": 2, "max_kv_gib": 39.9485, "max_kv_tokens": 290896,
        "derivation": {"weights_act_gib": 19.2063, "headroom_total_gib": 0.2248,
                       "rounding_cost_gib": 0.5689},
        "final": {"flags": {"gpu_memory_utilization": 0.9367, "max_model_len": 16384,
                            "max_num_seqs": 17}},
    }
    rep.update(extra)
    return rep


def v1_report(**extra: object) -> dict[str, object]:
    rep: dict[str, object] = {
        "run_id": "v", "method": "v1-pinned-kv", "engine": "vllm", "model": "qwen3-8b",
        "card_gib": 80, "validated": True, "launches": 2, "simulated": True,
        "derivation": {"device_total_mib": 81559, "non_kv_peak_mib": 20034.8, "margin_mib": 408},
        "final": {"kv_cache_memory_bytes": 64084770816, "kv_cache_gib": 59.684,
                  "kv_tokens": 434592, "max_model_len": 32768, "max_num_seqs": 256},
    }
    rep.update(extra)
    return rep


def test_r01_breakdown_sums_to_the_card() -> None:
    b = breakdown_r01(r01_report())
    assert b is not None
    assert b.total_mib == 64 * 1024
    assert sum(s.mib for s in b.segments) == pytest.approx(b.total_mib)
    kinds = [s.kind for s in b.segments]
    assert kinds == ["weights", "headroom", "rounding", "kv", "free"]
    # The pool (everything but the remainder) is card x util.
    assert sum(s.mib for s in b.segments[:-1]) == pytest.approx(64 * 1024 * 0.9367, abs=1)


def test_v1_breakdown_sums_to_the_device() -> None:
    b = breakdown_v1(v1_report())
    assert b is not None
    assert b.total_mib == 81559
    assert sum(s.mib for s in b.segments) == pytest.approx(81559)
    assert b.segments[1].mib == pytest.approx(61116)  # the pinned KV, from its bytes
    assert 0 <= b.segments[-1].mib < 1  # the KV rounded down to a MiB


def test_v1_breakdown_of_a_soaked_final_configuration() -> None:
    memory = {"launch": 4, "device_total_mib": 65536, "kv_held_mib": 47337.8,
              "non_kv_peak_mib": 16084.2, "soak_growth_mib": 1458, "held_back_mib": 442,
              "pinned_kv_mib": 47338.0, "free_mib": 213.8, "lines": []}
    b = breakdown_v1(v1_report(memory=memory))
    assert b is not None
    assert [s.kind for s in b.segments] == ["weights", "growth", "margin", "kv", "free"]
    assert sum(s.mib for s in b.segments) == pytest.approx(65536)
    assert b.segments[-1].mib == pytest.approx(memory["free_mib"])  # report.json's remainder
    assert "launch 4" in b.total_label


def test_soak_phases_are_tinted_and_its_levels_drawn(tmp_path: Path) -> None:
    phases = ["load", "images", "soak-1", "soak-2", "reset", "after-soak"]
    tsv = "# launch 1\nt_s\tphase\tdevice\tused_mib\n" + "".join(
        f"{t / 10}\t{p}\t0\t{60000 + 200 * t}\n" for t, p in enumerate(phases))
    soak = {"launch": 1, "before_mib": 60200, "after_mib": 60600}
    html = render_html(write_run(tmp_path / "run", v1_report(soak=soak), tsv))
    assert html.count('class="band soak"') == 4
    assert "after the soak 60,600 MiB (+400 MiB)" in html
    assert "before the soak 60,200 MiB" in html


def test_a_failed_run_has_no_breakdown() -> None:
    assert breakdown(r01_report(derivation={}, max_kv_gib=None)) is None
    assert breakdown(v1_report(derivation={})) is None


@given(total=st.floats(1, 1e6), parts=st.lists(st.floats(0, 1e5), min_size=1, max_size=5))
def test_segments_always_sum_to_the_card_or_say_the_overrun(total: float,
                                                            parts: list[float]) -> None:
    rep = v1_report(derivation={"device_total_mib": total, "non_kv_peak_mib": parts[0],
                                "margin_mib": sum(parts[1:])},
                    final={"kv_cache_memory_bytes": 0})
    b = breakdown_v1(rep)
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


def write_run(folder: Path, rep: dict[str, object], tsv: str | None = None) -> Path:
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(rep))
    (folder / "journal.jsonl").write_text(json.dumps(
        {"event": "decision", "decision": "derive", "reason": "<b>19 GiB</b> & more"}) + "\n")
    if tsv is not None:
        (folder / "launch-1").mkdir()
        (folder / "launch-1" / "memory.tsv").write_text(tsv)
    return folder


def test_page_escapes_and_shows_what_was_given_up(tmp_path: Path) -> None:
    rep = r01_report(model="<script>alert(1)</script>",
                     asked={"max_model_len": 16384, "max_num_seqs": None},
                     given_up=["max_model_len 11,264 < 16,384 asked"],
                     steps=[{"n": 1, "purpose": "validate", "outcome": "ok",
                             "settings": {"util": 0.9367}}])
    tsv = "# launch 1: read by fake; total_mib=65536\nt_s\tphase\tdevice\tused_mib\n" \
          "0.0\tlaunch\t0\t100\n1.0\tload\t0\t60000\n"
    html = render_html(write_run(tmp_path / "run", rep, tsv))
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;19 GiB&lt;/b&gt; &amp; more" in html
    assert "asked: max_model_len 16,384" in html
    assert "max_model_len 11,264 &lt; 16,384 asked" in html
    assert "SIMULATED" in html
    assert "card x util 0.9367" in html  # the r0.1 pool cap on the chart
    assert not EXTERNAL.search(html)


def test_page_without_asked_or_samples(tmp_path: Path) -> None:
    html = render_html(write_run(tmp_path / "run", v1_report(simulated=False)))
    assert 'class="banner asked"' not in html
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
