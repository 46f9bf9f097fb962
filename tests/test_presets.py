"""Presets: every shipped preset agrees with pretuner's KV math; lookup; run record -> preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretuner.errors import BadInputError
from pretuner.presets.model import (
    Preset,
    builtin_presets,
    check_preset,
    find_preset,
    get_preset,
    load_preset_file,
    preset_from_report,
    preset_line,
    preset_to_json,
)
from pretuner.report.records import RunReport, read_report

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("preset", builtin_presets(), ids=lambda p: p.name)
def test_preset_agrees_with_kv_math(preset: Preset) -> None:
    assert check_preset(preset) == []


def test_seed_figures() -> None:
    assert get_preset("qwen3-vl-8b-tp2-64g-vllm-ascend").kv_tokens == 645_120
    assert get_preset("qwen3-8b-tp2-20g-vllm").kv_tokens == 79_040
    ds = get_preset("deepseek-r1-w8a8-tp16-2x8x64g")
    assert ds.env["vLLM_MODEL_MEMORY_USE_GB"] == "53"
    assert ds.kv_gib == 6.52


def test_wrong_token_count_fails_the_check() -> None:
    p = get_preset("qwen3-vl-8b-tp2-64g-vllm-ascend")
    bad = preset_to_json(p) | {"kv_tokens": 700_160}
    path = Path(__file__).parent / "golden" / "run" / "report.json"  # any readable folder
    from pretuner.presets.model import preset_from_dict

    assert path.exists()
    assert check_preset(preset_from_dict(bad, "x"))


def test_unknown_key_rejected(tmp_path: Path) -> None:
    data = preset_to_json(get_preset("qwen3-8b-tp2-20g-vllm")) | {"kv_tokenz": 1}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(data))
    with pytest.raises(BadInputError, match="unknown preset key"):
        load_preset_file(f)


def test_json_round_trip() -> None:
    for p in builtin_presets():
        from pretuner.presets.model import preset_from_dict

        assert preset_from_dict(preset_to_json(p), p.name) == p


def test_find_preset() -> None:
    found = find_preset("Qwen/Qwen3-VL-8B-Instruct", 64, 2)
    assert found is not None
    assert found.name == "qwen3-vl-8b-tp2-64g-vllm-ascend"
    assert find_preset("qwen3-8b", 64, 2) is None
    assert find_preset("no-such-model", 64, 2) is None


def test_unknown_preset_suggests() -> None:
    with pytest.raises(BadInputError, match="did you mean"):
        get_preset("qwen3-8b-tp2-20g")


def test_from_report_is_consistent() -> None:
    rep = read_report(GOLDEN / "run")  # a report.json of schema 1: it still reads
    assert isinstance(rep, RunReport)
    p = preset_from_report(rep, date="2026-01-01")
    assert p.kind.value == "simulated"
    assert check_preset(p) == []


@pytest.mark.parametrize(("engine", "words"), [
    ("vllm", "80 GB cards"), ("vllm-ascend", "80 GB cards"), ("vllm-cpu", "80 GiB cards"),
    ("vllm-mindspore-r01", "80 GiB cards"), (None, "80 GiB cards"),
])
def test_the_preset_line_counts_the_card_in_its_engines_unit(engine: str | None,
                                                             words: str) -> None:
    """A V1 accelerator's --card counts GB (as the vendor sells it), r0.1's cards and the CPU
    engine's budget GiB: the line that finds no preset says the size the user typed."""
    line = preset_line("qwen3-8b", 80, 1, 1000, "measured", engine)
    assert line == f"preset: none for qwen3-8b on {words} at TP1"
