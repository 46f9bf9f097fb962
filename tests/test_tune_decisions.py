"""The tuning loop's decisions, in process and fast.

Two kinds of test:
- canned outcomes: a scripted card answers each launch (a weights+activations figure and an
  outcome kind), so every fallback rule is checked on its own, as a table;
- the emulated server run in this process (`tune_in_process`: the real command lines, server
  code, log lines, scanner and classifier, no processes), scored against the emulator's truth.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.outcome import LaunchOutcome, OutcomeKind
from pretuner.errors import InfeasibleError, NotValidatedError, ServerFailedError
from pretuner.models import resolve
from pretuner.sim import memory as mem
from pretuner.sim.executor import tune_in_process
from pretuner.sim.plugin import R01_CARDS
from pretuner.sim.truth import max_length, seqs_supported
from pretuner.tune.entry import RunOptions
from pretuner.tune.r01 import budget as bud
from pretuner.tune.r01.config import (
    CardInfo,
    TuneConfig,
    TuneResult,
    kv_prerun_bytes,
    pool_on_demand,
)
from pretuner.tune.r01.search import Measured, WaModel
from pretuner.tune.r01.setup import Tuner
from pretuner.units import GIB, MIB

# -- canned outcomes ------------------------------------------------------------------------


@dataclass
class ScriptedCard:
    """Answers launches like a card would: weights+activations `wa_gib(length)` beside the KV
    cache r0.1 allocates; `override(settings, n)` may force an outcome kind for a launch."""

    bpt: int
    wa_gib: Callable[[LaunchSettings], float]
    free_mib: int = 61_457
    per_seq_mib: float = 0.0  # what each running sequence beyond the first adds under load
    override: Callable[[LaunchSettings, int], OutcomeKind | None] = lambda s, n: None
    launches: list[LaunchSettings] = field(default_factory=list)
    # A device reader (npu-smi) sampling the card: its total, and what other components
    # allocate outside MindSpore's pool after MindSpore read the free memory. None: no reader.
    device_total_mib: int | None = None
    outside_mib: int = 0
    free_drift_mib: Callable[[int], int] = lambda n: 0  # the free memory launch n reads, less
    # MiB launch n's worst rank reports above the pool cap although every request answered
    # (what an engine whose pool outgrows its cap would print); 0: the peak stays in the pool.
    over_cap_mib: Callable[[int], int] = lambda n: 0

    def __call__(self, s: LaunchSettings) -> LaunchOutcome:
        self.launches.append(s)
        n = len(self.launches)
        kv = kv_prerun_bytes(s, self.bpt)
        load = s.max_num_seqs if s.purpose is Purpose.VALIDATE else 1
        non_kv = (self.wa_gib(s) * GIB + (load - 1) * self.per_seq_mib * MIB)
        peak = int((non_kv + kv) / MIB)
        pool = s.card_gib * s.util * 1024
        kind = self.override(s, n)
        if kind is None:
            kind = OutcomeKind.OOM_IN_REQUEST if peak > pool else OutcomeKind.OK
        ok = kind is OutcomeKind.OK
        shown = min(peak, int(pool)) + self.over_cap_mib(n)
        return LaunchOutcome(
            n=n, settings=s, kind=kind, worst_peak_mib=shown, rank_peaks_mib={"0": shown},
            oom_text=None if ok else "Out of memory (scripted)",
            requests_ok=load if ok else 0, requests_total=load, ready_s=0.0, request_s=0.0,
            stop_s=0.0, total_s=0.0, overhead_s=0.0, log_path=f"launch-{n}/server.log",
            device_free_mib=self.free_mib - self.free_drift_mib(n),
            device_total_mib=self.device_total_mib,
            device_peaks_mib={} if self.device_total_mib is None else {"run": int(
                self.device_total_mib - self.free_mib + self.free_drift_mib(n) + pool
                + self.outside_mib)},
        )  # fmt: skip


def tuner(card: ScriptedCard, model: str = "qwen3-8b", card_gib: int = 64, **kw: Any) -> Tuner:
    cfg = TuneConfig(model=resolve(model), card=CardInfo(card_gib, None, "given"), **kw)
    t = Tuner(cfg, card, lambda phase, detail: None)
    card.bpt = t.bpt
    return t


def names(t: Tuner) -> list[str]:
    return [d["decision"] for d in t.decisions]


def flat(gib: float) -> Callable[[LaunchSettings], float]:
    return lambda s: gib


def test_a_fitting_prerun_validates_in_two_launches() -> None:
    card = ScriptedCard(0, flat(20.0))
    res = tuner(card).run()
    assert res.validated
    assert [s.purpose for s in card.launches][:2] == [Purpose.PRERUN, Purpose.VALIDATE]
    # The final configuration holds the measured weights+activations and its KV in the pool.
    f = res.derivation.final
    assert f.vllm_model_memory_use_gb >= 20
    assert f.kv_bytes <= (64 * f.gpu_memory_utilization - f.vllm_model_memory_use_gb) * GIB


@pytest.mark.parametrize(
    "kind", [OutcomeKind.PROMPT_DROPPED, OutcomeKind.KV_EXHAUSTED, OutcomeKind.LEN_TOO_LARGE]
)
def test_a_probe_that_did_not_run_is_not_a_measurement(kind: OutcomeKind) -> None:
    card = ScriptedCard(0, flat(20.0), override=lambda s, n: kind if n == 1 else None)
    t = tuner(card)
    res = t.run()
    first, second = card.launches[:2]
    assert second.purpose is Purpose.PRERUN
    assert second.model_use_gib == first.model_use_gib - 1  # one GiB more KV for the watermark
    assert "give the pre-run more KV" in names(t)
    assert res.prerun is not None
    assert res.prerun.n == 2  # the derivation rests on a probe that ran


def test_weights_that_do_not_load_end_the_layout_after_one_retry() -> None:
    card = ScriptedCard(0, flat(20.0), override=lambda s, n: OutcomeKind.OOM_WEIGHTS)
    with pytest.raises(InfeasibleError, match="did not fit"):
        tuner(card).run()
    assert len(card.launches) <= 2  # at most one retry at the card's measured free memory


def test_a_failed_probe_without_oom_is_the_server_failing_not_the_model() -> None:
    card = ScriptedCard(0, flat(20.0), override=lambda s, n: OutcomeKind.REQUESTS_FAILED)
    with pytest.raises(ServerFailedError):
        tuner(card).run()
    assert len(card.launches) == 1


def test_a_validation_oom_is_learned_from_its_dump() -> None:
    # Each running sequence costs 600 MiB more than the model's sampler figure says: the first
    # validation runs out of memory; the next one runs fewer sequences and passes.
    card = ScriptedCard(0, flat(20.0), per_seq_mib=600)
    t = tuner(card)
    res = t.run()
    vals = [s for s in card.launches if s.purpose is Purpose.VALIDATE]
    assert res.validated
    assert "learn from the validation" in names(t)
    assert vals[1].max_num_seqs < vals[0].max_num_seqs
    assert res.validation is not None
    assert res.validation.kind is OutcomeKind.OK
    # The OOM's dump only bounds the need from below: half the load is measured with all the
    # room its KV leaves, and what that measures sets the final count (4 launches in all).
    assert len(card.launches) <= 4


def test_a_validation_whose_peak_passed_the_pool_cap_is_not_validated() -> None:
    # Rule: a validation proves a configuration only when its worst rank stayed within
    # card*util, even if every request answered. The first validation's rank reports 1,800 MiB
    # (3 %) above the cap: it is learned from like an OOM, and what stands is a later launch.
    card = ScriptedCard(0, flat(20.0), over_cap_mib=lambda n: 1800 if n == 2 else 0)
    t = tuner(card)
    res = t.run()
    assert card.launches[1].purpose is Purpose.VALIDATE
    assert res.validated
    assert res.validation is not None
    assert res.validation.n > 2
    verdicts = [n for n in names(t) if n in ("validated", "learn from the validation")]
    assert verdicts[0] == "learn from the validation"


def test_a_validation_oom_inflates_the_per_sequence_cost_its_dump_showed() -> None:
    # Rule: the pool dump of a validation that ran out of memory bounds the load's need only
    # from below (the allocation that failed is not in it), so the per-sequence cost learned
    # from it must exceed what the dump shows, by more than the dump's 1-MiB resolution.
    t = tuner(ScriptedCard(0, flat(20.0)))
    res = t.run()
    assert res.prerun is not None
    assert res.validation is not None
    seqs, shown_per_seq = 8, 50 * MIB
    settings = replace(res.validation.settings, max_num_seqs=seqs)
    need = (res.derivation.weights_act_bytes + t.base_headroom + (seqs - 1) * shown_per_seq)
    peak_mib = math.ceil((kv_prerun_bytes(settings, t.bpt) + need) / MIB)
    oom = replace(res.validation, settings=settings, kind=OutcomeKind.OOM_IN_REQUEST,
                  worst_peak_mib=peak_mib, rank_peaks_mib={"0": peak_mib}, requests_ok=0,
                  oom_text="Out of memory (scripted)")
    _, _, _, learned = t.learn(res.prerun, res.derivation, oom, per_seq=0)
    assert learned - shown_per_seq > MIB


@pytest.mark.parametrize(("length", "chunked"), [(8192, False), (8448, True)])
def test_only_a_prompt_longer_than_four_chunk_steps_switches_to_chunked_prefill(
    length: int, chunked: bool
) -> None:
    # Rule: a whole-prompt prefill that runs out of memory is cut into chunks (2,048-token
    # steps) only when the prompt is longer than 4 such steps; at 8,192 tokens or fewer the
    # length is shortened instead. Here a whole prompt costs 6 GiB per 1K tokens, a chunked one
    # nothing more than the weights.
    def wa(s: LaunchSettings) -> float:
        return 20.0 if s.chunked_prefill else 20.0 + 6 * s.max_model_len / 1024

    t = tuner(ScriptedCard(0, wa), max_model_len=length, min_model_len=2048)
    res = t.run()
    assert res.validated
    assert ("prefill in chunks" in names(t)) is chunked
    assert res.derivation.final.chunked_prefill is chunked
    assert (res.derivation.final.max_model_len == length) is chunked


@pytest.mark.parametrize(
    ("rank_peaks_mib", "spread_mib"),
    [({"0": 30_000}, 0), ({"0": 30_000, "1": 30_000}, 0), ({"0": 30_000, "1": 30_300}, 300),
     ({"0": 29_900, "1": 30_300, "2": 30_000}, 400)],
)
def test_ranks_that_differ_get_their_spread_as_headroom(
    rank_peaks_mib: dict[str, int], spread_mib: int
) -> None:
    # Rule: the pre-run measures the worst rank, but under load another rank may be the worst:
    # the base headroom grows by exactly the spread between the ranks' peaks.
    alone = bud.base_headroom_bytes(24 * GIB, 20 * GIB, {"0": 30_000}, None)
    got = bud.base_headroom_bytes(24 * GIB, 20 * GIB, rank_peaks_mib, None)
    assert got - alone == spread_mib * MIB


def test_a_length_beyond_the_measured_ones_keeps_a_margin_over_the_line() -> None:
    # Rule: attention can grow faster than linearly, so a length longer than any measured one
    # is predicted above the straight line through the measurements; inside the measured range
    # the chord between its neighbours is used as it is.
    w = 16 * GIB
    model = WaModel(weights_bytes=w, measured=[Measured(4096, w + GIB), Measured(8192, w + 2 * GIB)])
    line_at_16k = w + 4 * GIB
    assert model.predict(16384) > line_at_16k + 64 * MIB
    assert model.predict(6144) == w + GIB + GIB // 2


def test_a_length_that_does_not_fit_is_narrowed_to_within_1024_tokens() -> None:
    # 40 GiB + 2 GiB per 1K tokens of context, however the prompt is cut into steps: 16K does
    # not fit beside the KV of one sequence, chunked or not; the loop narrows between the
    # longest length that fitted and the shortest that did not.
    card = ScriptedCard(0, lambda s: 40.0 + s.max_model_len / 512)
    t = tuner(card, max_model_len=16384, min_model_len=4096)
    res = t.run()
    assert res.validated
    length = res.derivation.final.max_model_len
    assert 4096 <= length < 16384
    failed = [s.max_model_len for s in card.launches
              if s.purpose is Purpose.PRERUN and s.max_model_len > length]
    # Within 1024 tokens of a length that failed, unless the launch budget ran out first (it
    # keeps one launch for the validation); never a walk down one step at a time.
    assert min(failed) - length <= 1024 or len(card.launches) == t.cfg.max_launches
    assert "keep max_model_len" in names(t)


def test_flat_measurements_give_the_exact_edge_without_creeping() -> None:
    # 58 GiB whatever the length: only the KV of one sequence decides, and two measurements
    # that agree pin the edge at once (no launch per 256 tokens).
    card = ScriptedCard(0, flat(58.0))
    res = tuner(card, max_model_len=8192, min_model_len=4096).run()
    assert res.validated
    assert len(card.launches) <= 6


def test_infeasible_only_when_a_launch_at_the_minimum_length_failed() -> None:
    card = ScriptedCard(0, flat(61.0))  # more than the card's free memory: nothing fits
    t = tuner(card, max_model_len=8192, min_model_len=4096)
    with pytest.raises((InfeasibleError, NotValidatedError)) as err:
        t.run()
    if err.type is InfeasibleError:
        assert any(s.max_model_len <= 4096 for s in card.launches)


# -- the emulated server, in process ----------------------------------------------------------


def emulated(model: str, card: int, length: int, seed: int, occupied_mib: int = 0,
             **kw: Any) -> tuple[TuneResult, list[mem.CardModel], int]:
    work = Path(tempfile.mkdtemp(prefix="pretuner-decisions-"))
    env = {"PRETUNER_SIM_STARTUP_S": "0", "PRETUNER_SIM_TEARDOWN_S": "0",
           "PRETUNER_SIM_OCCUPIED_MIB": str(occupied_mib),
           "PRETUNER_SIM_STATE_DIR": str(work / "card")}
    prof = mem.PROFILES[R01_CARDS[card]]
    info = CardInfo(card, prof.total_mib - prof.driver_reserved_mib - occupied_mib, "emulated")
    opts = RunOptions(model=model, engine="sim", card_gib=card, max_model_len=length,
                      min_model_len=4096, seed=seed, sim_env=env, **kw)
    res = tune_in_process(opts, work, info)
    spec = resolve(model)
    p = res.plan
    layout = mem.Layout(tp=p.tp, pp=p.pp, block_size=p.block_size,
                        kv_dtype=str(kw.get("kv_cache_dtype", "auto")))
    models = mem.card_models(spec, spec.weights_format(p.weights_format).total_bytes, layout, seed)
    return res, models, prof.free_bytes - occupied_mib * MIB


def assert_kv_is_the_servers(res: TuneResult, models: list[mem.CardModel]) -> None:
    """The KV the tuner promises is what the emulated server allocates for the final settings
    (its own block sizes, not the tuner's arithmetic), and holds max-num-seqs sequences."""
    f = res.derivation.final
    block_bytes = models[0].block_bytes
    blocks = mem.r01_kv_blocks(f.ascend_total_memory_gb, f.gpu_memory_utilization,
                               f.vllm_model_memory_use_gb, block_bytes)
    assert (f.kv_tokens, f.kv_bytes) == (blocks * f.block_size, blocks * block_bytes)
    assert seqs_supported(f.kv_bytes, block_bytes, f.block_size, f.max_model_len) \
        >= f.max_num_seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qwen3_8b_on_32gb_at_32k_validates_without_a_validation_oom(seed: int) -> None:
    res, models, free = emulated("qwen3-8b", 32, 32768, seed, tp=1)
    assert res.validated
    assert_kv_is_the_servers(res, models)
    validations = [o for o in res.outcomes if o.settings.purpose is Purpose.VALIDATE]
    assert validations
    # Every validation, not only the last: a first one that ran out of memory fails this test.
    assert [o.kind for o in validations] == [OutcomeKind.OK] * len(validations)
    true_len = max(max_length(models, free, limit=32768, chunked=c, granularity=256)
                   for c in (False, True))
    chosen = res.derivation.final.max_model_len
    assert chosen >= min(32768, true_len) - 1024


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_qwen3_8b_on_24gb_is_never_called_infeasible_when_a_length_fits(seed: int) -> None:
    res, models, free = emulated("qwen3-8b", 24, 32768, seed, tp=1,
                                 occupied_mib=1500 if seed % 2 else 0)
    assert res.validated
    assert_kv_is_the_servers(res, models)
    true_len = max(max_length(models, free, limit=32768, chunked=c, granularity=256)
                   for c in (False, True))
    assert res.derivation.final.max_model_len >= min(32768, true_len) - 1024


def test_the_kv_dtype_reaches_the_server_and_its_kv_figure() -> None:
    res, models, _ = emulated("qwen3-8b", 32, 16384, 0, kv_cache_dtype="int8")
    last = res.outcomes[-1]
    assert last.settings.kv_cache_dtype == "int8"
    assert_kv_is_the_servers(res, models)
    auto, models, _ = emulated("qwen3-8b", 32, 16384, 0)
    assert_kv_is_the_servers(auto, models)
    # Half the bytes per token: about twice the tokens in a similar KV budget.
    tokens = res.derivation.final.kv_tokens
    assert tokens > 1.6 * auto.derivation.final.kv_tokens


# -- the memory the final configuration may take --------------------------------------------


def pool_mib(res: TuneResult) -> float:
    return 64 * 1024 * res.derivation.final.gpu_memory_utilization


@pytest.mark.parametrize("outside", [0, 300])
def test_the_reserve_is_what_the_device_held_outside_the_pool(outside: int) -> None:
    card = ScriptedCard(0, flat(20.0), device_total_mib=65_536, outside_mib=outside)
    res = tuner(card).run()
    # 8 MiB of hard margin on a 64 GB card, plus what npu-smi saw beside the pool, and the
    # util's 4 digits (6.5 MiB a step).
    room = card.free_mib - outside - 8
    assert room - 6.6 < pool_mib(res) <= room
    assert res.reserve_gib * 1024 == pytest.approx(8 + outside)
    assert f"{outside:,} MiB the device held outside the pool" in res.final_util_source


def test_a_pool_that_grows_on_demand_keeps_the_scaled_reserve() -> None:
    # With MindSpore's virtual-memory pool the device shows what the pool used, not its cap:
    # what lies outside the pool cannot be told apart, so the reserve stays a guess.
    card = ScriptedCard(0, flat(20.0), device_total_mib=65_536, outside_mib=300)
    res = tuner(card, pool_on_demand=True).run()
    assert res.reserve_gib == 0.25
    assert "enable_vmm" in res.final_util_source


@pytest.mark.parametrize(("conf", "on"), [("enable_vmm:true", True), ("", False),
                                          ("enable_vmm:false", False),
                                          ("enable_vmm: True,vmm_align_size:2MB", True)])
def test_the_virtual_memory_pool_is_read_from_ms_alloc_conf(conf: str, on: bool) -> None:
    assert pool_on_demand({"MS_ALLOC_CONF": conf}) is on


def test_without_a_device_reading_the_reserve_scales_with_the_card() -> None:
    res = tuner(ScriptedCard(0, flat(20.0))).run()
    assert res.reserve_gib == 0.25  # a 64 GB card, free memory measured by MindSpore
    # A guessed reserve lends the model-use budget's integer rounding back, to the hard margin.
    assert pool_mib(res) <= ScriptedCard.free_mib - 8
    assert "no device reading" in res.final_util_source


def test_free_memory_that_moves_between_launches_widens_the_margin() -> None:
    # The second launch reads 40 MiB less free memory than the first: from then on the pool
    # keeps that much more below the latest reading.
    card = ScriptedCard(0, flat(20.0), device_total_mib=65_536,
                        free_drift_mib=lambda n: 40 if n >= 2 else 0)
    t = tuner(card)
    t.run()
    assert len(card.launches) >= 2
    assert t.free is not None
    assert t.free.spread_mib == 40
    assert t.reserve() * 1024 == pytest.approx(8 + 40)
    assert 64 * 1024 * t.max_util(1.0) <= card.free_mib - 40 - 48
    assert "40 MiB of it how far the free memory moved" in t.reserve_words()


@pytest.mark.parametrize(("wa_gib", "use"), [(19.99, 21), (19.5, 20), (19.25, 20)])
def test_a_tightening_keeps_the_boot_noise_floor_even_at_the_integer_edge(
    wa_gib: float, use: int
) -> None:
    # Rule: the model-use budget keeps at least the boot-noise floor (pretuner.noise: 500 MiB on
    # a 64 GB card) above the full load, even where that costs a whole GiB of KV: 10 MiB below
    # 20 GiB rounds it up to 21 GiB (the old integer edge kept 2 MiB there); 512 MiB or more
    # below, 20 GiB keeps it.
    card = ScriptedCard(0, flat(wa_gib), device_total_mib=65_536)
    t = tuner(card)
    res = t.run()
    assert res.validated
    assert res.derivation.final.vllm_model_memory_use_gb == use
    assert use * 1024 - wa_gib * 1024 >= 500
    assert res.validation is not None
    assert res.validation.kind is OutcomeKind.OK
