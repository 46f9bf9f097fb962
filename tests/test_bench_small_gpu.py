"""scripts/bench_small_gpu.py stays runnable: one card and model end to end (in process, a few
seconds), the field note's settings, and the 7 GB budget's tenant."""

from __future__ import annotations

import pytest

from tests.helpers import load_script

bench = load_script("bench_small_gpu")


def test_one_card_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--cards", "20", "--models", "qwen3-8b", "--no-budget"]) == 0
    out = capsys.readouterr().out
    assert "pretuner: --quantization fp8, --kv-cache-memory-bytes" in out
    assert "fits: True" in out
    assert "hand-made (the note's util 0.12): did not start" in out


def test_the_budget_leaves_seven_gib_of_torchs_capacity() -> None:
    # cuda-32: NVML 32,768 MiB, 310 MiB idle; 7 GiB left to torch
    assert bench.budget_occupied_mib(32, 7) == 32768 - 310 - 7 * 1024


def test_the_notes_7gb_config_is_refused_on_a_7gb_budget() -> None:
    occupied = bench.budget_occupied_mib(32, 7)
    h = bench.hand_made("7 GB", bench.NOTE_70B_7G, 32, occupied)
    assert not h.started
    assert h.why.startswith("refused: util x total above the free")
    whole = bench.hand_made("whole card", bench.NOTE_70B_7G, 32, 0)
    assert whole.started
    assert whole.served == whole.sent
    assert whole.decode_tps is not None
    assert 0.2 < whole.decode_tps < 0.6  # the note measured 0.4 tokens/s
