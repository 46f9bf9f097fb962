"""A vision-language validation's soak: its figures from sampled phases, and what the V1 loop
decides from them (canned outcomes against a scripted card, milliseconds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.engines.v1_images import Soak
from pretuner.launch import images as I
from pretuner.models import resolve
from pretuner.tune.pinned.loop import V1Config, V1Tuner
from pretuner.tune.pinned.report import soak_record
from pretuner.tune.pinned.soak import soak_figures, soak_rate
from pretuner.units import GIB, MIB

SPEC = resolve("qwen3-vl-8b")
BPT = 73_728  # Qwen3-VL-8B TP2
TOTAL = 65_536
TIGHTEN_MIB = 66  # the tightening margin: 0.1 % of 65,536 MiB, rounded up
FLOOR_MIB = 500  # the boot-noise floor kept on 65,536 MiB (pretuner.noise; 1 % is 656)
NON_KV = 16_000  # MiB before the soak


def _outcome(s: LaunchSettings, kind: OutcomeKind, *, peaks: dict[str, int],
             last: dict[str, int] | None = None, tokens: int | None = None, n: int = 1,
             alloc: int | None = None) -> LaunchOutcome:
    return LaunchOutcome(
        n=n, settings=s, kind=kind, worst_peak_mib=None, rank_peaks_mib={},
        oom_text=f"CUDA out of memory. Tried to allocate {alloc / MIB:.2f} MiB" if alloc else None,
        requests_ok=1, requests_total=1, ready_s=1.0, request_s=1.0, stop_s=1.0, total_s=3.0,
        overhead_s=0.0, log_path="server.log", weights_gib=8.2, oom_alloc_bytes=alloc,
        kv_tokens=tokens, kv_gib=tokens * BPT / GIB if tokens else None,
        device_peaks_mib=peaks, device_reader="scripted", device_total_mib=TOTAL,
        device_last_mib=last or {}, soak_requests=200 if last else 0,
        reset_status=200 if last else None)


def test_figures_from_the_phases() -> None:
    s = V1Tuner(_cfg(), _no_launch, _quiet).settings(Purpose.VALIDATE, 0.9, 40 * GIB)
    o = _outcome(s, OutcomeKind.OK,
                 peaks={"start": 60_000, "load": 61_000, "images": 62_500, "soak-1": 63_700,
                        "soak-2": 64_000, "reset": 64_000, "after-soak": 64_300, "stop": 64_000},
                 last={"images": 62_100, "soak-1": 63_700, "soak-2": 64_000, "reset": 64_000})
    f = soak_figures(o)
    assert f is not None
    assert (f.growth_mib, f.second_half_mib, f.reset_gave_back_mib) == (1_900, 300, 0)
    assert f.held_back_mib == 600  # two more doublings at the second half's rate
    assert (f.peak_before_mib, f.peak_after_mib, f.peak_growth_mib) == (62_500, 64_300, 1_800)
    assert soak_figures(replace(o, device_last_mib={"images": 1})) is None  # no soak ran
    refused = soak_figures(replace(o, reset_status=404))  # no dev mode: the route is not there
    assert refused is not None
    assert (refused.after_reset_mib, refused.reset_gave_back_mib) == (None, None)


# -- the soak's growth rate and the time its headroom lasts -----------------------------------


def _series(used: list[int], every_s: float) -> list[tuple[float, int]]:
    return [(100.0 + i * every_s, mib) for i, mib in enumerate(used)]


def test_a_flat_soak_grows_at_zero_and_never_uses_the_headroom_up() -> None:
    r = soak_rate(_series([30_000] * 40, 20.0), 2_000)
    assert (r.rate_mib_per_h, r.bound, r.samples, r.span_s) == (0.0, "fit", 40, 780.0)
    assert r.exhaustion_h is None


def test_a_rising_soak_long_enough_projects_the_hours_the_headroom_lasts() -> None:
    # 2 MiB every 20 s = 0.1 MiB/s = 360 MiB/h; 720 MiB of headroom lasts 720 / 360 = 2 h.
    r = soak_rate(_series([30_000 + 2 * i for i in range(36)], 20.0), 720)
    assert r.bound == "fit"
    assert r.rate_mib_per_h == pytest.approx(360.0)
    assert r.exhaustion_h == pytest.approx(2.0)
    assert soak_rate(_series([30_000 + 2 * i for i in range(36)], 20.0), -5).exhaustion_h == 0


def test_one_noisy_read_in_the_middle_makes_no_growth() -> None:
    # The least-squares slope weighs every sample: a spike at the middle moves it by nothing
    # (max - min over the time would read 500 MiB of growth into it).
    used = [30_000] * 41
    used[20] = 30_500
    assert soak_rate(_series(used, 20.0), 2_000).rate_mib_per_h == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("count", "every_s"), [(5, 1.0), (100, 5.0), (20, 60.0)])
def test_a_soak_too_short_or_too_thin_gives_an_upper_bound(count: int, every_s: float) -> None:
    # Under 10 minutes or under 30 samples: 1 MiB per sample is an upper bound on the rate,
    # so the headroom lasts at least headroom / rate.
    r = soak_rate(_series([30_000 + i for i in range(count)], every_s), 1_000)
    assert r.bound == "upper bound"
    assert r.rate_mib_per_h == pytest.approx(3600 / every_s)
    assert r.exhaustion_h == pytest.approx(1_000 * every_s / 3600)


@pytest.mark.parametrize("points", [[], [(1.0, 30_000)], [(1.0, 30_000), (2.0, 30_100)],
                                    [(5.0, 30_000)] * 4])
def test_too_few_samples_or_no_time_is_not_measurable(points: list[tuple[float, int]]) -> None:
    r = soak_rate(points, 1_000)
    assert (r.rate_mib_per_h, r.bound, r.exhaustion_h) == (None, "not measurable", None)


def test_the_record_carries_the_rate_and_says_how_sure_it_is() -> None:
    s = V1Tuner(_cfg(), _no_launch, _quiet).settings(Purpose.VALIDATE, 0.9, 40 * GIB)
    last = {"images": 62_100, "soak-1": 63_700, "soak-2": 64_000, "reset": 64_000}
    o = _outcome(s, OutcomeKind.OK, peaks={"images": 62_500, "soak-1": 63_700,
                                           "soak-2": 64_000}, last=last)
    # 4 MiB a second for 10 s: at most 14,400 MiB/h; 65,536 - 64,000 = 1,536 MiB lasts at
    # least 1,536 / 14,400 = 0.1067 h
    short = soak_record(replace(o, soak_series=tuple(_series(
        [63_960 + 4 * i for i in range(11)], 1.0))), Soak(200))
    assert short is not None
    assert (short.rate_mib_per_h, short.rate_bound, short.headroom_mib, short.exhaustion_h) == (
        14_400.0, "upper bound", 1_536, 0.107)
    assert short.settled  # the second half added 300 of 1,900 MiB: under a quarter
    line = short.rate_line("simulated")
    assert "growth rate at most 14,400.0 MiB/h" in line
    assert "used up in at least 6.4 min at that rate" in line  # under an hour: minutes
    assert "host RSS of the engine's processes not sampled" in line
    long = soak_record(replace(o, soak_series=tuple(_series(
        [63_960 + 2 * i for i in range(36)], 20.0))), Soak(200))
    assert long is not None  # 360 MiB/h, measured long enough: 1,536 / 360 = 4.27 h
    assert (long.rate_mib_per_h, long.rate_bound, long.exhaustion_h) == (360.0, "fit", 4.267)
    assert "growth rate 360.0 MiB/h" in long.rate_line("measured")
    assert "used up in 4.3 h at that rate (derived)" in long.rate_line("measured")
    # The journal keeps the samples: a resumed run reports the same rate.
    kept = replace(o, soak_series=((1.5, 63_960), (2.5, 63_964)))
    assert LaunchOutcome.from_json(json.loads(json.dumps(kept.to_json()))) == kept
    none = soak_record(o, Soak(200))  # no samples kept (a journal from before the rate)
    assert none is not None
    assert none.rate_mib_per_h is None
    assert "growth rate: not measurable (0 device samples" in none.rate_line("measured")


# -- the loop against a card whose memory grows under the soak -------------------------------


def _cfg(**kw: Any) -> V1Config:
    base: dict[str, Any] = {"model": SPEC, "card_gib": 64, "bytes_per_token": BPT,
                               "max_model_len": 65536, "max_num_seqs": 8,
                               "max_num_batched_tokens": 32768, "tp": 2}
    return V1Config(**{**base, **kw})


def _quiet(phase: str, detail: str) -> None:
    return


def _no_launch(s: LaunchSettings) -> LaunchOutcome:
    raise AssertionError("no launch expected")


def soaking_card(growth: int, second_half: int,
                 calls: list[LaunchSettings]) -> Callable[[LaunchSettings], LaunchOutcome]:
    """Non-KV 16,000 MiB before the soak; the soak adds `growth` MiB, `second_half` of it in
    its second half; a KV that leaves no room for the growth dies in the soak."""

    def execute(s: LaunchSettings) -> LaunchOutcome:
        calls.append(s)
        n = len(calls)
        kv = s.kv_cache_bytes if s.kv_cache_bytes is not None else 45 * GIB
        tokens = kv // (16 * BPT) * 16
        before = round(NON_KV + tokens * BPT / MIB)
        if s.purpose is Purpose.PRERUN:
            return _outcome(s, OutcomeKind.OK, peaks={"probe": before}, tokens=tokens, n=n)
        if before + growth > TOTAL:
            return _outcome(s, OutcomeKind.OOM_IN_REQUEST, peaks={"images": before,
                            "soak-1": TOTAL}, tokens=tokens, n=n, alloc=64 * MIB)
        after = before + growth
        half = after - second_half
        return _outcome(s, OutcomeKind.OK, tokens=tokens, n=n,
                        peaks={"load": before - 500, "images": before, "soak-1": half,
                               "soak-2": after, "reset": after, "after-soak": after},
                        last={"images": before, "soak-1": half, "soak-2": after,
                              "reset": after})

    return execute


def test_growth_that_kills_the_soak_backs_off_then_holds_the_second_half_back() -> None:
    calls: list[LaunchSettings] = []
    r = V1Tuner(_cfg(), soaking_card(2_000, 400, calls), _quiet).run()
    assert r.validated
    names = [d["decision"] for d in r.decisions]
    assert names[:2] == ["derive", "back off"]
    final = r.outcomes[-1]
    f = soak_figures(final)
    assert f is not None
    # What the final configuration leaves free at its worst moment covers what the soak's
    # second half still added, and the margin.
    assert TOTAL - f.peak_after_mib >= f.second_half_mib + FLOOR_MIB


def test_a_second_half_that_still_grows_lowers_the_kv_and_proves_it_again() -> None:
    calls: list[LaunchSettings] = []
    card = soaking_card(1_500, 700, calls)
    tuner = V1Tuner(_cfg(), card, _quiet)
    s = tuner.settings(Purpose.VALIDATE, 0.9, (TOTAL - NON_KV - 1_500 - 100) * MIB)
    o = card(s)
    tuner.outcomes.append(o)
    proven = tuner.result(s, True, o.kv_tokens)
    r = tuner.tighten(s, o, proven)
    decision = next(d for d in r.decisions if d["decision"] == "hold back")
    f = soak_figures(o)
    assert f is not None
    left = TOTAL - max(o.device_peaks_mib.values())  # about the 100 MiB the KV was given
    short = f.held_back_mib + FLOOR_MIB - left
    assert f.held_back_mib == 2 * 700
    cut = short + TIGHTEN_MIB  # and the margin again: no creeping
    assert decision["kv_cache_bytes"] == (s.kv_cache_bytes or 0) - cut * MIB
    assert calls[-1].kv_cache_bytes == decision["kv_cache_bytes"]  # proven in its own launch
    assert r.final.kv_cache_bytes == decision["kv_cache_bytes"]


def test_a_proof_that_keeps_the_hold_and_the_floor_is_not_lowered() -> None:
    # No creeping: a peak that leaves exactly the growth held back and the floor stands.
    calls: list[LaunchSettings] = []
    card = soaking_card(1_500, 200, calls)
    tuner = V1Tuner(_cfg(), card, _quiet)
    room = 2 * 200 + FLOOR_MIB + 10  # 10 MiB more than hold + floor
    s = tuner.settings(Purpose.VALIDATE, 0.9, (TOTAL - NON_KV - 1_500 - room) * MIB)
    o = card(s)
    tuner.outcomes.append(o)
    r = tuner.tighten(s, o, tuner.result(s, True, o.kv_tokens))
    assert r.final == s
    assert len(calls) == 1


def test_no_launch_left_keeps_the_proven_and_says_so() -> None:
    calls: list[LaunchSettings] = []
    card = soaking_card(1_500, 700, calls)
    tuner = V1Tuner(_cfg(max_launches=1), card, _quiet)
    s = tuner.settings(Purpose.VALIDATE, 0.9, (TOTAL - NON_KV - 1_500 - 100) * MIB)
    o = card(s)
    tuner.outcomes.append(o)
    proven = tuner.result(s, True, o.kv_tokens)
    assert tuner.tighten(s, o, proven).final == s
    assert [d["decision"] for d in tuner.decisions] == ["headroom short"]


def test_a_settled_soak_holds_nothing_back_and_may_widen() -> None:
    calls: list[LaunchSettings] = []
    card = soaking_card(1_500, 0, calls)
    tuner = V1Tuner(_cfg(), card, _quiet)
    s = tuner.settings(Purpose.VALIDATE, 0.9, 40 * GIB)
    o = card(s)
    tuner.outcomes.append(o)
    r = tuner.tighten(s, o, tuner.result(s, True, o.kv_tokens))
    assert "hold back" not in [d["decision"] for d in r.decisions]
    f = soak_figures(r.outcomes[-1])
    assert f is not None
    assert len(r.outcomes) == 2  # widened once, proven in its own launch
    tail = (r.final.kv_cache_bytes or 0) / MIB - (r.kv_tokens or 0) * BPT / MIB  # unallocated
    assert TOTAL - f.peak_after_mib == pytest.approx(FLOOR_MIB + TIGHTEN_MIB + tail, abs=1)


# -- the requests -------------------------------------------------------------------------------


def test_worst_case_fills_max_model_len_with_the_most_largest_images() -> None:
    v = SPEC.vision
    assert v is not None
    shape = I.image_shape(v, 999)
    req = I.worst_case(shape, 65536, 16, "w", template_tokens=8)
    assert len(req.images) == 3  # 4 x 16,386 tokens do not fit beside the template
    assert req.image_tokens + req.text_tokens + 8 + 16 == 65536
    assert I.worst_case_images(I.image_shape(v, 2), 65536, 16) == (2, 4096)
    one, side = I.worst_case_images(shape, 8192, 16)
    assert one == 1
    assert side < 4096  # the largest image that fits in 8,192 tokens


@pytest.mark.parametrize("limit", [1, 2, 999])
def test_soak_requests_vary_fit_and_are_distinct(limit: int) -> None:
    v = SPEC.vision
    assert v is not None
    shape = I.image_shape(v, limit)
    reqs = [I.soak_request(shape, 16384, 7, i) for i in range(200)]
    assert reqs == [I.soak_request(shape, 16384, 7, i) for i in range(200)]  # deterministic
    uids = [a.uid for r in reqs for a in r.images]
    assert len(uids) == len(set(uids))
    assert len({(a.width_px, a.height_px) for r in reqs for a in r.images}) > 20
    assert all(len(r.images) <= limit for r in reqs)
    assert all(r.image_tokens + r.text_tokens + I.TEMPLATE_TOKENS_GUESS + r.max_tokens <= 16384
               for r in reqs)


def test_validation_phases_with_and_without_a_soak() -> None:
    v = SPEC.vision
    assert v is not None
    shape = I.image_shape(v, 2)
    plain = I.validation_phases(shape, 32768, 16, 5, 0, 0)
    assert [p.name for p in plain] == ["worst", "images"]
    soaked = I.validation_phases(shape, 32768, 16, 5, 41, 0)
    assert [p.name for p in soaked] == ["worst", "images", "soak-1", "soak-2", "after-soak"]
    assert [len(p.requests) for p in soaked] == [1, 5, 21, 20, 5]
    assert soaked[3].reset
    first = {a.uid for r in soaked[1].requests for a in getattr(r, "images", ())}
    again = {a.uid for r in soaked[4].requests for a in getattr(r, "images", ())}
    assert first.isdisjoint(again)  # the burst after the soak is new images, not cache hits


def test_soak_minutes_plan_a_bound_and_words() -> None:
    assert Soak(200).planned == 200
    assert Soak(None, 2.0).planned == 1200
    assert Soak(50, 1.0).words() == "50 requests or 1 min, whichever ends first"
    assert not Soak(0).on
