"""The engine's own advice: vLLM's `--kv-cache-memory=` suggestion after profiling (INFO since
PR 47374, DEBUG before) is read from its log, shown beside pretuner's pinned KV, never adopted.
The log is the real vLLM 0.24.0 H200 pre-run with that one line added (tests/fixtures/logs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import Exercised, OutcomeKind
from pretuner.engines.v1_launch import V1Hooks, read_log
from pretuner.logscan.events import KvAdvice
from pretuner.logscan.lines import parse_line
from pretuner.report.records import PinnedDerivation, RunReport, read_report
from pretuner.tune.pinned.report_sections import pinned_sections, summary_lines

FIXTURES = Path(__file__).parent / "fixtures"
ADVICE_LOG = FIXTURES / "logs" / "vllm-h200-prerun-kv-advice.log"
REAL = FIXTURES / "real" / "vllm-0.24-h200" / "run8k"
SUGGESTED = next(line for line in ADVICE_LOG.read_text().splitlines()
                 if "--kv-cache-memory=" in line)


@pytest.mark.parametrize(
    ("line", "advice"),
    [
        (SUGGESTED, KvAdvice(116279276994, 130709884764)),
        # vLLM issue 57936: CUDA-graph memory counted twice, the suggestion can go negative
        ("DEBUG [gpu_worker.py:1033] Free memory on device (10.0/79.18 GiB) on startup. Replace "
         "gpu_memory_utilization config with `--kv-cache-memory=-2147483648` (-2.0 GiB) to fit "
         "into requested memory, or `--kv-cache-memory=1073741824` (1.0 GiB) to fully utilize "
         "gpu memory.", KvAdvice(-2147483648, 1073741824)),
    ],
)
def test_the_advice_line_parses(line: str, advice: KvAdvice) -> None:
    """The rule: both suggested sizes are read in bytes, a negative one as it is."""
    assert parse_line(line) == advice


def test_the_log_with_advice_scans_like_the_real_one_plus_the_advice() -> None:
    """The rule: the added line changes nothing else the scan reads of the real log."""
    real = read_log(REAL / "launch-1" / "server.log")
    advised = read_log(ADVICE_LOG)
    assert real.advice is None
    assert advised.advice == KvAdvice(116279276994, 130709884764)
    assert advised.kv_tokens == real.kv_tokens is not None
    assert advised.available_kv_gib == real.available_kv_gib is not None


def test_a_launch_outcome_carries_the_advice(tmp_path: Path) -> None:
    """The rule: the pre-run's outcome keeps the advice for the report, in bytes."""
    settings = LaunchSettings(Purpose.PRERUN, 140, 0.9, 0, 8192, 256, 8192, 16, 1)
    ran = Exercised(ok=1, total=1, dropped=0, error=None)
    o = V1Hooks(bytes_per_token=147456).outcome(1, settings, ADVICE_LOG, ran, None, None,
                                                (1.0, 1.0, 1.0, 3.0))
    assert o.kind is OutcomeKind.OK
    assert (o.advised_kv_bytes, o.advised_full_kv_bytes) == (116279276994, 130709884764)


def test_the_report_shows_the_advice_beside_ours_and_keeps_ours() -> None:
    """The rule: report.md and the run summary print the engine's suggestion next to the KV
    pretuner pinned, and the pinned KV (report.json, the flags) stays pretuner's."""
    rep = read_report(REAL)
    assert isinstance(rep, RunReport)
    d = rep.derivation
    assert isinstance(d, PinnedDerivation)
    advice = read_log(ADVICE_LOG).advice
    assert advice is not None
    base = d.baseline.model_copy(update={"advised_kv_bytes": advice.requested_bytes,
                                         "advised_full_kv_bytes": advice.full_bytes})
    rep = rep.model_copy(update={"derivation": d.model_copy(update={"baseline": base})})
    d = rep.derivation
    assert isinstance(d, PinnedDerivation)
    ours = d.kv_cache_memory_bytes
    assert ours not in (advice.requested_bytes, advice.full_bytes)
    for lines in (summary_lines(rep, d), pinned_sections(rep, d)):
        shown = [line for line in lines if "the engine's own advice" in line]
        assert len(shown) == 1
        assert f"--kv-cache-memory={advice.requested_bytes} B (108.29 GiB)" in shown[0]
        assert f"{advice.full_bytes} B (121.73 GiB) to fill the device" in shown[0]
        assert f"pretuner pinned {ours} B" in shown[0]
        assert "not adopted" in shown[0]
    flags = rep.final.flags
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(ours)
