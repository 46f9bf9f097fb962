"""The pre-run method for V1 engines: from a measured device peak to `--kv-cache-memory-bytes`.

V1 engines (vLLM >= 0.8, vllm-ascend, vLLM-MindSpore >= 0.3) size the KV cache by their own
profiling, which misses what comes after it (CUDA graph capture, the sampler warm-up, the
allocator's cache) and keeps `1 - util` of the card idle for it. Measured instead:

    non-KV peak  = device peak during start-up and the worst-case request - KV cache held
    pinned KV    = device total - non-KV peak - margin

The non-KV peak holds everything the engine needs besides its KV cache at its worst moment:
the driver's own reservation, the runtime context, weights, graph pools, the largest prefill
step and any other tenant of the card. It does not depend on the KV size (the H100 runs in
`../shared/real-logs/vllm-0.24-h100` show 20,032-20,048 MiB at 54.8, 59 and 60 GiB of KV).

The margin covers what one sampled run can miss: a transient shorter than the sampling
interval and the allocator's run-to-run spread. A failed validation backs off by the
allocation its OOM names plus the margin, and the result is proven again.
Pure arithmetic: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretuner import noise
from pretuner.units import GIB, MIB

MARGIN_FLOOR_MIB = 256
MARGIN_SHARE = 0.005  # of the device total
TIGHTEN_MARGIN_FLOOR_MIB = 32
TIGHTEN_MARGIN_SHARE = 0.001  # of the device total, kept free below the validation's peak


def margin_mib(total_mib: int) -> int:
    """What a back-off takes beyond the allocation an OOM named: 0.5 % of the device, at least
    256 MiB (a sampled peak can miss a short transient)."""
    return max(MARGIN_FLOOR_MIB, math.ceil(total_mib * MARGIN_SHARE))


def tighten_margin_mib(total_mib: int) -> int:
    """What one proof's peak may lie above another's of the same KV (the pre-run's, a
    validation's): 0.1 % of the device, at least 32 MiB."""
    return max(TIGHTEN_MARGIN_FLOOR_MIB, math.ceil(total_mib * TIGHTEN_MARGIN_SHARE))


def derive_margin_mib(total_mib: int) -> int:
    """What the pinned KV leaves free below the pre-run's peak: the back-off margin, at least the
    boot-noise floor (`pretuner.noise`) plus what the proof may add, so that the proof keeps
    that floor without another launch."""
    return max(margin_mib(total_mib),
               noise.floor_mib(total_mib) + tighten_margin_mib(total_mib))


def margin_words(total_mib: int) -> str:
    """What the derivation's margin is made of (`derive_margin_mib`), as the output says it."""
    share = margin_mib(total_mib)
    spread, proof = noise.floor_mib(total_mib), tighten_margin_mib(total_mib)
    return (f"margin {derive_margin_mib(total_mib):,} MiB = the larger of {share:,} MiB "
            f"({MARGIN_SHARE * 100:g} % of the device, at least {MARGIN_FLOOR_MIB} MiB: a sampled "
            f"peak can miss a short transient) and {spread + proof:,} MiB (the boot-to-boot "
            f"spread kept, {spread:,} MiB, + {proof:,} MiB a proof may peak above the pre-run)")


def kv_held_bytes(kv_tokens: int | None, bytes_per_token: int, kv_gib: float | None) -> int | None:
    """The KV cache a launch held: its token count times the bytes per token (exact: vLLM
    allocates whole blocks), else the GiB figure the engine printed (two decimals)."""
    if kv_tokens is not None and bytes_per_token > 0:
        return kv_tokens * bytes_per_token
    if kv_gib is not None:
        return int(kv_gib * GIB)
    return None


@dataclass(frozen=True, slots=True)
class PinnedBudget:
    """The derivation of one pinned KV budget, every figure in MiB unless named otherwise."""

    total_mib: int  # the device, as its reader reports it
    peak_mib: int  # the worst device's highest sample during start-up and the probe
    held_kv_mib: float  # the KV cache the measured launch held
    source: str  # what measured the peak ("emulated", "nvml", "nvidia-smi", ...)

    @property
    def margin_mib(self) -> int:
        return derive_margin_mib(self.total_mib)

    @property
    def non_kv_mib(self) -> float:
        return self.peak_mib - self.held_kv_mib

    @property
    def kv_mib(self) -> int:
        """The pinned KV, whole MiB, never negative."""
        return max(0, math.floor(self.total_mib - self.non_kv_mib - self.margin_mib))

    @property
    def kv_bytes(self) -> int:
        return self.kv_mib * MIB

    def lines(self) -> list[str]:
        """The arithmetic as printed; each line's figures add up to its result."""
        how = "simulated" if self.source == "emulated" else "measured"
        return [
            f"non-KV peak = device peak {self.peak_mib:,} MiB ({self.source}, {how}) "
            f"- KV held {self.held_kv_mib:,.1f} MiB = {self.non_kv_mib:,.1f} MiB",
            f"pinned KV = device total {self.total_mib:,} MiB - non-KV peak "
            f"{self.non_kv_mib:,.1f} MiB - margin {self.margin_mib:,} MiB = "
            f"{self.kv_mib:,} MiB ({self.kv_mib / 1024:.2f} GiB, derived), rounded down to a MiB",
            margin_words(self.total_mib),
        ]


def derive_pinned(total_mib: int, peak_mib: int, held_kv_bytes: int, source: str) -> PinnedBudget:
    """The pinned KV budget a measured launch supports."""
    return PinnedBudget(total_mib, peak_mib, held_kv_bytes / MIB, source)


def back_off_bytes(kv_bytes: int, alloc_bytes: int | None, total_mib: int) -> int:
    """The next pinned KV after an OOM: less by what the failed allocation asked plus the
    margin (at least the margin when the OOM did not say), whole MiB."""
    step = (alloc_bytes or 0) + margin_mib(total_mib) * MIB
    return max(0, (kv_bytes - step) // MIB * MIB)
