"""Byte units (1024-based everywhere) and the provenance tag every printed figure carries."""

from __future__ import annotations

from enum import Enum

KIB = 1024
MIB = 1024**2
GIB = 1024**3


class Provenance(str, Enum):
    """Where a figure comes from; printed next to it."""

    MEASURED = "measured"  # read from a real log or device
    DERIVED = "derived"  # computed from measured figures and the model spec
    PREDICTED = "predicted"  # computed from the model spec alone (plan)
    SIMULATED = "simulated"  # measured on the emulated card
    GIVEN = "given"  # supplied by the user


def gib(n_bytes: float) -> float:
    return n_bytes / GIB


def mib(n_bytes: float) -> float:
    return n_bytes / MIB


def gib_to_bytes(value_gib: float) -> int:
    return int(value_gib * GIB)


def mib_to_bytes(value_mib: float) -> int:
    return int(value_mib * MIB)


def fmt_gib(n_bytes: float, digits: int = 2) -> str:
    return f"{n_bytes / GIB:,.{digits}f} GiB"


def fmt_mib(n_bytes: float) -> str:
    return f"{n_bytes / MIB:,.0f} MiB"


def fmt_tokens(n: int) -> str:
    return f"{n:,} tokens"
