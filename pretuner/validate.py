"""Checks for values a user hands in (flags, journals): each refusal names the value and the fix.

Pure: the CLI and `RunOptions.check()` call the same rules, so a library caller meets the same
`BadInputError` (exit 2) as the command line, before anything is launched or written.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import PurePath
from typing import Any

from pretuner.errors import BadInputError

# vLLM's --block-size choices (CacheConfig); r0.1 uses 16, vLLM-MindSpore 0.5 uses 128.
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Far above any accelerator on the market (the largest hold under 300 GiB): a larger --card
# is a typo, and would derive millions of sequences against a server that trusts it.
MAX_CARD_GIB = 1024
# A week: past it a timeout is a typo (`1e10` overflows the socket's and the clock's range).
MAX_WAIT_S = 7 * 24 * 3600
NAME_MAX = 255  # bytes in one file name on Linux's filesystems


def finite(flag: str, value: float, *, example: str) -> None:
    """Refuse a nan or infinite `value`."""
    if not math.isfinite(value):
        raise BadInputError(f"{flag} {value} is not a finite number", hint=f"e.g. {flag} {example}")


# The checks below pass a value that was not given (None).
def non_negative(flag: str, value: float | None, *, example: str) -> None:
    """A finite `value` >= 0."""
    if value is None:
        return
    finite(flag, value, example=example)
    if value < 0:
        raise BadInputError(f"{flag} {value} is negative",
                            hint=f"use 0 or more, e.g. {flag} {example}")


def positive(flag: str, value: float | None, *, example: str) -> None:
    """A finite `value` > 0."""
    if value is None:
        return
    finite(flag, value, example=example)
    if value <= 0:
        raise BadInputError(f"{flag} {value} must be above 0", hint=f"e.g. {flag} {example}")


def at_most(flag: str, value: float | None, most: float, *, unit: str) -> None:
    """A `value` not above `most`."""
    if value is not None and value > most:
        raise BadInputError(f"{flag} {value:g} {unit} is above the limit of {most:g} {unit}",
                            hint=f"use {most:g} or less")


def int_range(flag: str, value: int | None, low: int, high: int | None = None) -> None:
    """An integer in [low, high] (no upper bound when high is None)."""
    if value is not None and (value < low or (high is not None and value > high)):
        span = f"at least {low}" if high is None else f"between {low} and {high}"
        raise BadInputError(f"{flag} {value} is invalid", hint=f"use a value {span}")


def choice(flag: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """`value` when it is one of `choices`."""
    if value not in choices:
        valid = ", ".join(str(c) for c in choices)
        raise BadInputError(f"{flag} {value!r} is not supported", hint=f"choose one of: {valid}")
    return value


def layout(card_gib: int | None, util: float | None, tp: int | None, pp: int | None,
           block_size: int | None, headroom_gib: float | None) -> None:
    """The layout options `run` and `analyze` both take, by the same rules (None: not given)."""
    if card_gib is not None and card_gib < 1:
        raise BadInputError(f"card size {card_gib} GiB is invalid",
                            hint="pass the card's GiB, e.g. --card 64")
    int_range("--card", card_gib, 1, MAX_CARD_GIB)
    if util is not None:
        finite("--util", util, example="0.9")
        if not 0 < util <= 1:
            raise BadInputError(f"--util {util} is outside (0, 1]",
                                hint="use the fraction of the card, e.g. 0.9")
    int_range("--tp", tp, 1)
    int_range("--pp", pp, 1)
    if block_size is not None:
        choice("--block-size", block_size, BLOCK_SIZES)
    non_negative("--headroom-gb", headroom_gib, example="1")


def path_text(flag: str, value: str) -> str:
    """A path that names something: not empty or blank (which would mean the current folder)."""
    if not value.strip():
        raise BadInputError(f"{flag} {value!r} is empty",
                            hint=f"name a folder, e.g. {flag} runs/r1")
    if any(len(os.fsencode(part)) > NAME_MAX for part in PurePath(value).parts):
        raise BadInputError(f"{flag} {value!r} has a name over {NAME_MAX} bytes",
                            hint="the filesystem refuses it: use shorter names")
    return value


def command_line(flag: str, value: str) -> list[str]:
    """A shell-like command split into argv: quotes balanced, not empty."""
    try:
        argv = shlex.split(value)
    except ValueError as err:
        raise BadInputError(
            f"{flag} {value!r} cannot be split into arguments: {err}",
            hint=f"balance the quotes, e.g. {flag} \"--opt 'a b'\"",
        ) from None
    if not argv:
        raise BadInputError(f"{flag} is empty", hint=f"e.g. {flag} 'my-wrapper serve'")
    return argv
