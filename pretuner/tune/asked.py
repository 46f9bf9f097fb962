"""What a run gave up against what was asked: a shorter length, fewer sequences.

A validated configuration that serves less than asked is not a plain success: the report's
headline says so and `pretuner run` exits 9 (README, "Exit codes").
"""

from __future__ import annotations

from collections.abc import Sequence

from pretuner.engines.base import Purpose
from pretuner.engines.outcome import LaunchOutcome


def given_up(
    asked_len: int, asked_seqs: int | None, final_len: int,
    final_seqs: int,
    *,
    seqs_from: str = "asked",
) -> list[str]:
    """One line per cut: "max_model_len 11,264 < 16,384 asked"."""
    cuts = []
    if final_len < asked_len:
        cuts.append(f"max_model_len {final_len:,} < {asked_len:,} asked")
    if asked_seqs is not None and final_seqs < asked_seqs:
        cuts.append(f"max-num-seqs {final_seqs} < {asked_seqs} {seqs_from}")
    return cuts


def first_validation_seqs(outcomes: Sequence[LaunchOutcome]) -> int | None:
    """The r0.1 method's promise: the sequences its first validation was derived to serve."""
    return next((o.settings.max_num_seqs for o in outcomes
                 if o.settings.purpose is Purpose.VALIDATE), None)
