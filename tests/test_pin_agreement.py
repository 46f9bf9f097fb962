"""A pinned KV the engine did not take fails the launch (issue 28 item 2): the engine's own KV
figure and the device's measured peak must agree with `--kv-cache-memory-bytes`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pretuner.tune.pinned.loop import pin_disagreement
from pretuner.units import GIB, MIB
from tests.helpers import FAST_SIM, cli_env, run_cli

PIN = 64_084_770_816  # 59.68 GiB, what the emulated H100 run of qwen3-8b at 8,192 tokens pins


@pytest.mark.parametrize(
    ("pin", "engine_gib", "peak_mib", "says"),
    [
        # The engine prints its pool rounded to 2 decimals (GPU) or 1 (CPU): that is agreement.
        pytest.param(PIN, 59.68, 81_167, None, id="log-and-device-agree"),
        pytest.param(PIN, 59.7, 81_167, None, id="one-decimal-rounding"),
        pytest.param(PIN, PIN / GIB - 0.049, 81_167, None, id="within-the-tolerance"),
        # 1.05 GiB pinned, printed "1.0" by vLLM on the CPU: the widest rounding there is.
        pytest.param(round(1.05 * GIB), 1.0, 2_000, None, id="half-a-printed-step"),
        # A smuggled --kv_cache_memory_bytes 20000000000 behind a wrapper: the log says 18.63.
        pytest.param(PIN, 18.63, 39_125, "engine's log reports a KV cache of 18.63 GiB",
                     id="smuggled"),
        pytest.param(PIN, PIN / GIB + 0.06, 81_167, "59.74 GiB", id="past-the-tolerance"),
        # No log figure, but the device never held the pool: it was never allocated.
        pytest.param(PIN, None, 39_125, "device's peak was 39,125 MiB", id="device-below-pin"),
        pytest.param(PIN, None, None, None, id="nothing-to-compare"),
    ],
)
def test_the_engine_and_the_device_must_report_the_pinned_kv(
        pin: int, engine_gib: float | None, peak_mib: int | None, says: str | None) -> None:
    why = pin_disagreement(pin, engine_gib, peak_mib, "emulated")
    if says is None:
        assert why is None
    else:
        assert why is not None
        assert says in why
        assert "59.68 GiB" in why


def test_nothing_pinned_is_nothing_to_disagree_with() -> None:
    # A pre-run the engine profiles at a util: its KV is the engine's to size.
    assert pin_disagreement(None, 18.63, 100 * MIB, "emulated") is None


@pytest.mark.slow
def test_a_pin_the_engine_did_not_take_fails_the_launch_with_both_figures(tmp_path: Path) -> None:
    # Seen in issue 28: a second KV flag behind a wrapper (argparse keeps the last) went past
    # the check on flags pretuner owns, and the run reported VALIDATED with 101 GiB "pinned"
    # on an 80 GB card.
    wrapper = tmp_path / "smuggle.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m pretuner.sim vllm serve "$@" '
                       "--kv-cache-memory-bytes 20000000000\n")
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                   "--max-model-len", "8192", "--serve-cmd", str(wrapper), "--out", str(out),
                   env=cli_env(**FAST_SIM))
    assert proc.returncode == 5, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert "did not take the pinned KV cache" in error
    # The figure named is what pretuner pinned on launch 2, not the wrapper's 20,000,000,000 B.
    argv = json.loads((out / "launch-2" / "command.json").read_text())["argv"]
    pinned = argv[argv.index("--kv-cache-memory-bytes") + 1]
    assert pinned != "20000000000"
    assert f"--kv-cache-memory-bytes {pinned}" in error
    assert "18.63 GiB" in error  # 20,000,000,000 B, as the engine logged it
    assert not (out / "serve.sh").exists()
