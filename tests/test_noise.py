"""Boot-to-boot noise and the headroom it asks (`pretuner.noise`, `--repeat-proof`): the floor
rule and the spread rule as tables, then the V1 method's decisions against a scripted card
whose peak moves from boot to boot (milliseconds)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pretuner import noise
from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome
from pretuner.pinned import derive_margin_mib
from pretuner.tune.pinned.loop import V1Result, V1Tuner
from pretuner.tune.r01.config import TuneResult
from tests.test_v1_method import NON_KV, TOTAL, _cfg, scripted_card

H200_TOTAL = 143_771  # tests/fixtures/real/vllm-0.24-h200-burst


# Rule: without a measured spread the headroom is the largest spread any repeated proof has
# shown (500 MiB, the real H200 under a burst), never more than max(256 MiB, 1 % of the card);
# a measured spread above that is kept whole.
@pytest.mark.parametrize(("total_mib", "spread_mib", "floor_mib"), [
    (24_576, 0, 256),  # 24 GB: 1 % is 246 MiB, so the 256 MiB cap
    (32_768, 0, 328),  # 32 GB: 1 % (327.68, rounded up) caps the 500
    (65_536, 0, 500),  # a 64 GB Ascend card: 1 % is 656 MiB, the 500 seen stands
    (81_559, 0, 500),  # H100 80GB
    (H200_TOTAL, 0, 500),  # the H200 the 500 MiB was measured on
    (81_559, 26, 500),  # a measured spread under the floor does not lower it
    (24_576, 400, 400),  # measured noise above the cap is kept: it demands it
    (81_559, 700, 700),
])
def test_the_headroom_floor(total_mib: int, spread_mib: int, floor_mib: int) -> None:
    assert noise.floor_mib(total_mib, spread_mib) == floor_mib


# Rule: the spread is max - min of the boots' proof peaks; the shortfall is what the kept
# headroom (total - the highest peak) lacks of the floor or the spread, whichever is more.
@pytest.mark.parametrize(("peaks", "spread", "total", "short"), [
    ((143_165, 143_191), 26, H200_TOTAL, 0),  # the real H200's proof load: 580 MiB kept
    ((143_169, 143_669), 500, H200_TOTAL, 398),  # its burst: 102 MiB kept of 500
    ((80_000,), 0, 81_559, 0),  # one boot: no spread, 1,559 MiB kept
    ((80_900, 81_000, 80_950), 100, 81_559, 0),  # 559 MiB kept, 500 asked
    ((80_400, 81_100), 700, 81_559, 241),  # 459 MiB kept, the spread asks 700
])
def test_the_spread_and_the_shortfall(peaks: tuple[int, ...], spread: int, total: int,
                                      short: int) -> None:
    assert noise.spread_mib(peaks) == spread
    assert noise.short_mib(total, max(peaks), spread) == short


def test_the_v1_derivation_margin_covers_the_floor_and_what_a_proof_adds() -> None:
    # 0.5 % of an H100 (408 MiB) is under the floor: the derivation keeps the floor plus 0.1 %
    # (82 MiB) that the proof's peak may add, so the default run needs no third launch.
    assert derive_margin_mib(81_559) == 500 + 82
    assert derive_margin_mib(H200_TOTAL) == 719  # 0.5 % of the H200 is already more


# -- the V1 method against a card whose peak moves ----------------------------------------

def noisy_card(extra_mib: dict[int, int], launches: list[LaunchSettings]) -> Any:
    """The scripted H100 of tests/test_v1_method.py, its non-KV peak higher by extra_mib[n] on
    launch n (1-based; 0 where not named)."""

    def execute(s: LaunchSettings) -> LaunchOutcome:
        launches.append(s)
        n = len(launches)
        o: LaunchOutcome = scripted_card(NON_KV + extra_mib.get(n, 0))(s)
        return replace(o, n=n)

    return execute


def _tune(extra: dict[int, int], **kw: Any) -> tuple[V1Result, list[LaunchSettings]]:
    launches: list[LaunchSettings] = []
    r = V1Tuner(_cfg(**kw), noisy_card(extra, launches), lambda phase, detail: None).run()
    return r, launches


def _kept(r: V1Result) -> int:
    """Device total - the highest peak of the launches that proved the final configuration."""
    proofs = [o for o in r.outcomes if o.settings == r.final]
    return TOTAL - max(max(o.device_peaks_mib.values()) for o in proofs)


# Rule: the output says what the derivation's margin is made of, and its figures add up to it.
@pytest.mark.parametrize(("total", "share", "spread", "proof"), [
    (H200_TOTAL, 719, 500, 144), (81_559, 408, 500, 82), (24_000, 256, 256, 32)])
def test_the_derivation_says_what_its_margin_is_made_of(total: int, share: int, spread: int,
                                                         proof: int) -> None:
    from pretuner.pinned import derive_pinned

    lines = derive_pinned(total, total - 1_000, 0, "nvml").lines()
    margin = max(share, spread + proof)
    assert f"- margin {margin:,} MiB = " in lines[1]
    assert lines[2] == (
        f"margin {margin:,} MiB = the larger of {share:,} MiB (0.5 % of the device, at least "
        f"256 MiB: a sampled peak can miss a short transient) and {spread + proof:,} MiB (the "
        f"boot-to-boot spread kept, {spread:,} MiB, + {proof:,} MiB a proof may peak above the "
        "pre-run)")


def test_by_default_two_launches_keep_the_floor() -> None:
    r, launches = _tune({})
    assert r.validated
    assert len(launches) == 2
    assert _kept(r) >= noise.floor_mib(TOTAL)


def test_a_proof_that_leaves_less_than_the_floor_is_held_back_and_proven_again() -> None:
    # The validation peaks 200 MiB above what the pre-run showed (no OOM): kept 582 - 200.
    r, launches = _tune({2: 200, 3: 200})
    assert r.validated
    assert len(launches) == 3
    assert [d["decision"] for d in r.decisions][-2:] == ["hold back", "validated"]
    assert _kept(r) >= noise.floor_mib(TOTAL)


def test_repeat_proof_reports_each_boot_and_keeps_a_spread_above_the_floor() -> None:
    # The second boot peaks 560 MiB higher (every odd launch from 3): the spread asks more than
    # the floor and more than the first proof kept, so the KV is lowered by the shortfall and
    # proven again on two boots.
    r, launches = _tune({3: 560, 5: 560}, repeat_proof=2)
    assert r.validated
    assert len(launches) == 5
    assert all(s.purpose is Purpose.VALIDATE for s in launches[1:])
    assert r.boot_peaks_mib[1] - r.boot_peaks_mib[0] == 560
    assert TOTAL - max(r.boot_peaks_mib) >= 560
    names = [d["decision"] for d in r.decisions]
    assert names[-5:] == ["validated", "boot spread", "hold back", "validated", "boot spread"]
    assert r.decisions[-1]["boot_peaks_mib"] == list(r.boot_peaks_mib)
    assert r.decisions[-1]["spread_mib"] == 560


def test_a_repeated_boot_that_runs_out_of_memory_backs_off_and_proves_again() -> None:
    r, launches = _tune({3: 700, 5: 700}, repeat_proof=2)
    assert r.validated
    assert len(launches) == 5
    assert "back off" in [d["decision"] for d in r.decisions]
    assert noise.spread_mib(r.boot_peaks_mib) == 700
    assert TOTAL - max(r.boot_peaks_mib) >= 700


def test_repeat_proof_with_no_launch_left_says_the_headroom_is_short() -> None:
    r, launches = _tune({3: 560}, repeat_proof=2, max_launches=3)
    assert r.validated
    assert len(launches) == 3
    assert r.boot_peaks_mib[1] - r.boot_peaks_mib[0] == 560
    assert r.decisions[-1]["decision"] == "headroom short"
    assert "--max-launches 3" in r.decisions[-1]["detail"]


def test_a_spread_under_the_floor_needs_no_more_launches() -> None:
    r, launches = _tune({3: 50}, repeat_proof=2)
    assert len(launches) == 3
    assert noise.spread_mib(r.boot_peaks_mib) == 50
    assert TOTAL - max(r.boot_peaks_mib) >= noise.floor_mib(TOTAL) == 500


# -- r0.1: the pool keeps the floor and the spread ------------------------------------------

def _r01_kept(res: TuneResult) -> int:
    """The pool cap (card x util) - the highest worst-rank peak of the final proof's boots."""
    assert res.validation is not None
    s = res.validation.settings
    return round(s.card_gib * s.util * 1024) - max(res.boot_peaks_mib)


def test_r01_keeps_the_floor_in_the_pool_even_without_repeat_proof() -> None:
    # Rule: no run ends with less headroom than the floor. The baseline's validation keeps
    # `kept` MiB in the pool; a card whose validation peaks kept - 200 MiB higher (no OOM)
    # leaves 200 MiB, under the 500 MiB floor: derived again with more headroom, proven again.
    from tests.test_tune_decisions import ScriptedCard, flat, names, tuner

    base = tuner(ScriptedCard(0, flat(20.0), device_total_mib=65_536)).run()
    kept = _r01_kept(base)
    assert kept >= 500
    card = ScriptedCard(0, flat(20.0), device_total_mib=65_536)
    card.wa_gib = lambda s: 20.0 + ((kept - 200) / 1024 if len(card.launches) == 2 else 0)
    t = tuner(card)
    res = t.run()
    assert res.validated
    assert "hold back" in names(t)
    # The lowered one proven; a tightening may win the GiB back when its own proof has room.
    assert len(card.launches) in (3, 4)
    assert _r01_kept(res) >= 500


def test_r01_repeat_proof_keeps_the_spread_of_its_boots() -> None:
    from tests.test_tune_decisions import ScriptedCard, flat, names, tuner

    card = ScriptedCard(0, flat(20.0), device_total_mib=65_536)
    # Every third launch (the repeated boot) holds 700 MiB more.
    card.wa_gib = lambda s: 20.0 + (700 / 1024 if len(card.launches) % 2 == 1
                                    and len(card.launches) > 1 else 0)
    t = tuner(card, repeat_proof=2)
    res = t.run()
    assert res.validated
    assert len(res.boot_peaks_mib) == 2
    assert noise.spread_mib(res.boot_peaks_mib) >= 690
    assert _r01_kept(res) >= noise.spread_mib(res.boot_peaks_mib)
    assert "boot spread" in names(t)
