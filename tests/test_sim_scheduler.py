"""The emulator's V0 scheduler (watermark, ignored prompts, chunked prefill) and its truth."""

from __future__ import annotations

import pytest

from pretuner.models import resolve
from pretuner.sim import memory as mem
from pretuner.sim.loop import blocks_for
from pretuner.sim.scheduler import (
    Scheduler,
    SchedulerLimits,
    Seq,
    capacity_warning,
    watermark_blocks,
)
from pretuner.sim.truth import max_length, max_safe_kv, non_kv_peak, seqs_supported
from pretuner.units import GIB


def run_to_end(s: Scheduler, max_steps: int = 10_000) -> list[list[tuple[int, int]]]:
    shapes: list[list[tuple[int, int]]] = []
    for _ in range(max_steps):
        if s.idle:
            return shapes
        plan = s.plan()
        if plan.empty:
            break
        shapes.append(plan.prefill_shape())
        s.commit(plan)
    return shapes


@pytest.mark.parametrize(
    ("blocks", "prompt", "outcome"),
    [
        # 2048 blocks of 16: watermark 20 blocks. A prompt of 2028 blocks leaves exactly 20.
        pytest.param(2048, 2028 * 16, "runs", id="leaves-exactly-the-watermark"),
        pytest.param(2048, 2028 * 16 + 1, "ignored", id="one-token-into-the-watermark"),
        pytest.param(2048, 16383, "runs", id="16k-prompt-in-2048-blocks"),
        pytest.param(1024, 16383, "ignored", id="16k-prompt-exactly-filling-the-cache"),
        pytest.param(99, 99 * 16, "runs", id="small-cache-watermark-0"),
    ],
)
def test_watermark_decides_if_a_prompt_can_ever_run(blocks: int, prompt: int, outcome: str) -> None:
    s = Scheduler(SchedulerLimits(65536, 4, 65536, 16, blocks))
    s.add(Seq("a", prompt, 1))
    plan = s.plan()
    if outcome == "ignored":
        assert [i.warning for i in plan.ignored] == [capacity_warning(prompt)]
        assert plan.empty
        assert s.idle
    else:
        assert not plan.ignored
        assert plan.prefill_shape() == [(prompt, prompt)]


def test_watermark_makes_a_second_prompt_wait_then_run() -> None:
    blocks = 300
    s = Scheduler(SchedulerLimits(4096, 8, 8192, 16, blocks))
    per_seq = blocks_for(2400, 16)  # 150 blocks; two would leave 0 < watermark 3
    s.add(Seq("a", 2400, 2))
    s.add(Seq("b", 2400, 2))
    first = s.plan()
    assert [c.seq.request_id for c in first.chunks] == ["a"]
    assert s.free_blocks == blocks - per_seq
    s.commit(first)
    second = s.plan()
    assert second.decodes
    assert not second.chunks
    s.commit(second)
    shapes = run_to_end(s)
    assert (2400, 2400) in [c for step in shapes for c in step]  # b ran once a finished
    assert s.free_blocks == blocks


def test_prompt_limit_without_chunking() -> None:
    s = Scheduler(SchedulerLimits(8192, 4, 4096, 16, 10_000))
    s.add(Seq("a", 5000, 1))
    plan = s.plan()
    assert plan.ignored[0].warning.endswith("exceeds limit of 4096")


def test_chunked_prefill_splits_a_long_prompt_and_mixes_decodes() -> None:
    s = Scheduler(SchedulerLimits(65536, 4, 2048, 16, 20_000, chunked_prefill=True))
    s.add(Seq("short", 100, 5))
    s.add(Seq("long", 5000, 1))
    shapes = run_to_end(s)
    chunks = [c for step in shapes for c in step]
    assert (100, 100) in chunks
    long_chunks = [c for c in chunks if c[0] != 100]
    assert sum(n for n, _ in long_chunks) == 5000
    assert all(n <= 2048 for n, _ in long_chunks)
    assert long_chunks[-1][1] == 5000  # the last chunk attends over the whole prompt
    assert s.free_blocks == 20_000


def test_decode_preempts_when_blocks_run_out() -> None:
    # Two prompts of 15 tokens in 3 blocks (watermark 0): each grows past its block.
    s = Scheduler(SchedulerLimits(64, 2, 64, 16, 3))
    s.add(Seq("a", 15, 8))
    s.add(Seq("b", 15, 8))
    run_to_end(s)
    assert s.idle
    assert s.free_blocks == 3


def test_truth_matches_the_watermark_and_integer_rounding() -> None:
    spec = resolve("qwen3-8b")
    models = mem.card_models(spec, spec.weights_format(None).total_bytes, mem.Layout(), 3)
    prof = mem.PROFILES["910b-64"]
    bb = models[0].block_bytes
    assert seqs_supported(1024 * bb, bb, 16, 16384) == 0  # a cache of exactly one sequence
    assert seqs_supported(1035 * bb, bb, 16, 16384) == 1
    r01 = max_safe_kv(models, prof.free_bytes, 16384, batched=16384, chunked=False)
    phys = max_safe_kv(models, prof.free_bytes, 16384, batched=16384, chunked=False,
                       integer_model_use=False)
    assert r01 is not None
    assert phys is not None
    assert r01.model_use_gib is not None
    assert r01.model_use_gib * GIB >= r01.non_kv_peak_bytes > (r01.model_use_gib - 1) * GIB
    assert 0 <= phys.kv_bytes - r01.kv_bytes < GIB + bb
    assert r01.max_num_seqs <= seqs_supported(r01.kv_bytes, bb, 16, 16384)
    # One more sequence would not fit beside its own non-KV peak.
    more = r01.max_num_seqs + 1
    room = -(-non_kv_peak(models, 16384, more, 16384, False) // GIB) * GIB
    assert seqs_supported(prof.free_bytes - room, bb, 16, 16384) < more


def test_truth_max_length_grows_with_chunking_and_card() -> None:
    spec = resolve("qwen3-8b")
    models = mem.card_models(spec, spec.weights_format(None).total_bytes, mem.Layout(), 0)
    small = mem.PROFILES["310p-24"].free_bytes
    whole = max_length(models, small, limit=40960, chunked=False)
    chunked = max_length(models, small, limit=40960, chunked=True)
    assert 0 < whole <= chunked < 40960
    assert max_length(models, mem.PROFILES["910b-64"].free_bytes, limit=40960,
                      chunked=False) == 40960
    assert max_safe_kv(models, small, whole, batched=whole, chunked=False) is not None
    assert max_safe_kv(models, small, whole + 16, batched=whole + 16, chunked=False) is None


def test_watermark_blocks_is_vllms() -> None:
    assert watermark_blocks(99) == 0
    assert watermark_blocks(100) == 1
    assert watermark_blocks(2048) == 20
