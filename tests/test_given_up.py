"""What a run gave up against what was asked, and the command that runs it again."""

from __future__ import annotations

import dataclasses

import pytest

from pretuner.tune.options import RETUNE_FLAGS, RunOptions
from pretuner.tune.report import given_up


@pytest.mark.parametrize(("args", "cuts"), [
    ((16384, 17, 16384, 17), []),
    ((16384, None, 11264, 1), ["max_model_len 11,264 < 16,384 asked"]),
    ((16384, 4, 16384, 1), ["max-num-seqs 1 < 4 asked"]),
    ((40960, 8, 32768, 2), ["max_model_len 32,768 < 40,960 asked", "max-num-seqs 2 < 8 asked"]),
    ((8192, 4, 16384, 8), []),  # more than asked is not a cut
])  # fmt: skip
def test_given_up_lists_each_cut(args: tuple[int, int | None, int, int], cuts: list[str]) -> None:
    assert given_up(*args) == cuts


# Options that are not a choice about the run: where it is written, what only tests set.
NOT_RETUNED = {"model", "out", "runs_dir", "host", "sim_env"}


def test_every_run_option_has_its_retune_flag() -> None:
    fields = {f.name for f in dataclasses.fields(RunOptions)}
    assert fields - NOT_RETUNED == {name for name, _ in RETUNE_FLAGS}


def test_the_retune_command_names_what_differs_from_the_defaults() -> None:
    opts = RunOptions(model="qwen3-8b", engine="vllm", emulate=True, card_gib=80, max_model_len=32768,
                      util=0.85, validate=False, server_args=["--load-format dummy"])
    assert opts.command_line() == [
        "pretuner", "run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
        "--max-model-len", "32768", "--util", "0.85", "--no-validate",
        "--server-arg", "--load-format dummy",
    ]  # fmt: skip
    assert RunOptions(model="m").command_line() == ["pretuner", "run", "--model", "m"]
