"""A V1 run's weights knobs: `--quantization`, `--cpu-offload-gb`, `--swap-space`,
`--enforce-eager`. Checked before any launch (the quantization the checkpoint allows, the
host memory offload and swap need), then written into the run record.

The loop never varies them: each launch of a run loads the weights the same way, and only the
KV cache is derived and proven.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pretuner import validate as v
from pretuner.devices.cpu import HostMemory
from pretuner.engines.v1_knobs import Flag, Knobs, gib_text
from pretuner.errors import BadInputError, InfeasibleError
from pretuner.models.quant import METHODS
from pretuner.plan.layout import PlanResult
from pretuner.report.records import V1Weights
from pretuner.units import GIB

if TYPE_CHECKING:
    from pretuner.tune.options import RunOptions

SWAP_REFUSE_SHARE = 0.7  # vLLM refuses --swap-space x TP above this share of the host's total


KNOB_FLAGS = ("--quantization", "--cpu-offload-gb", "--swap-space", "--enforce-eager")


def knobs_of(opts: RunOptions, server_args: tuple[Flag, ...] = ()) -> tuple[Knobs,
                                                                          tuple[Flag, ...]]:
    """The run's knobs, and the other server flags: a knob given as a --server-arg (as
    before pretuner knew them) is taken as if given as pretuner's own flag, once."""
    values: dict[str, str | None] = {}
    rest: list[Flag] = []
    for name, value in server_args:
        if name not in KNOB_FLAGS:
            rest.append((name, value))
            continue
        own = {"--quantization": opts.quantization is not None,
               "--cpu-offload-gb": bool(opts.cpu_offload_gib),
               "--swap-space": opts.swap_space_gib is not None,
               "--enforce-eager": opts.enforce_eager}[name]
        if own or name in values:
            raise BadInputError(f"{name} is given twice (as pretuner's flag or a --config key, "
                                "and in --server-arg)", hint=f"give {name} once")
        values[name] = value
    try:
        offload = float(values.get("--cpu-offload-gb") or opts.cpu_offload_gib)
        swap = values.get("--swap-space")
        knobs = Knobs(
            (values.get("--quantization") or opts.quantization or "").lower() or None,
            offload, float(swap) if swap is not None else opts.swap_space_gib,
            opts.enforce_eager or "--enforce-eager" in values)
    except ValueError as err:
        raise BadInputError(f"--server-arg: {err}", hint="e.g. --cpu-offload-gb 14") from None
    if knobs.quantization is not None:
        v.choice("--quantization", knobs.quantization, METHODS)
    v.non_negative("--cpu-offload-gb", knobs.cpu_offload_gib, example="14")
    if knobs.swap_space_gib is not None:
        v.non_negative("--swap-space", knobs.swap_space_gib, example="4")
    return knobs, tuple(rest)


def check_host(p: PlanResult, knobs: Knobs, host: HostMemory | None) -> str | None:
    """Refuse (exit 4) offload or swap the host cannot hold; the line a decision records."""
    wp = p.weights_plan
    if wp is None or host is None:
        return None
    cards = p.tp * p.pp
    offload = wp.offload_bytes_per_card * cards
    swap = int(knobs.swap_gib * GIB) * p.tp
    if swap > SWAP_REFUSE_SHARE * host.total_bytes:
        most = int(SWAP_REFUSE_SHARE * host.total_bytes / GIB) // p.tp
        raise InfeasibleError(
            f"--swap-space {gib_text(knobs.swap_gib)} x TP{p.tp} = {swap / GIB:.2f} GiB is more "
            f"than {SWAP_REFUSE_SHARE:.0%} of the host's {host.total_bytes / GIB:.2f} GiB "
            f"({host.provenance}, {host.source}): vLLM refuses it at start-up",
            hint=f"use --swap-space {most} or less (the V1 engine preempts by recomputing; 0 is "
            "fine)")
    if offload > host.available_bytes:
        raise InfeasibleError(
            f"--cpu-offload-gb {gib_text(knobs.cpu_offload_gib)} keeps {offload / GIB:.2f} GiB of "
            f"weights in pinned host memory ({cards} card(s)), more than the "
            f"{host.available_bytes / GIB:.2f} GiB the host has available ({host.provenance}, "
            f"{host.source})",
            hint="lower --cpu-offload-gb (quantize with --quantization bitsandbytes first), free "
            "host memory, or use more cards (--tp)")
    if not offload:
        return None
    return (f"--cpu-offload-gb {gib_text(knobs.cpu_offload_gib)}: {offload / GIB:.2f} GiB of "
            f"weights in pinned host memory, {wp.card_weights_bytes / GIB:.2f} GiB per card left "
            f"on the card (predicted); host {host.words()}")


def weights_record(p: PlanResult, knobs: Knobs, host: HostMemory | None,
                   log_gib: float | None) -> V1Weights | None:
    """The run record's `weights` block."""
    wp = p.weights_plan
    if wp is None:
        return None
    cards = p.tp * p.pp
    return V1Weights(
        quantization=knobs.quantization, loaded_as=wp.quantization or p.weights_format,
        cpu_offload_gib=knobs.cpu_offload_gib, swap_space_gib=knobs.swap_space_gib,
        enforce_eager=knobs.enforce_eager,
        loaded_gib_per_card=round(wp.loaded_bytes_per_card / GIB, 3),
        offloaded_gib_per_card=round(wp.offload_bytes_per_card / GIB, 3),
        card_weights_gib=round(wp.card_weights_bytes / GIB, 3),
        card_weights_log_gib=log_gib,
        host_offload_gib=round(wp.offload_bytes_per_card * cards / GIB, 3),
        host_swap_gib=round(knobs.swap_gib * p.tp, 3),
        host_available_gib=round(host.available_bytes / GIB, 3) if host else None,
        host_total_gib=round(host.total_bytes / GIB, 3) if host else None,
        host_provenance=host.provenance if host else None,
    )


def widen_hint(err: InfeasibleError, knobs: Knobs) -> None:
    """An infeasible length on a small card: also name the knobs that make room for KV."""
    more = [] if knobs.enforce_eager else ["--enforce-eager (no CUDA-graph pool on the card)"]
    more.append("a larger --cpu-offload-gb (weights to the host: slower decode)"
                if knobs.cpu_offload_gib else "--cpu-offload-gb N (weights to the host: slower "
                "decode)")
    if not knobs.quantization:
        more.append("--quantization bitsandbytes (4-bit weights)")
    err.hint = f"{err.hint or ''}; or make room on the card: {', '.join(more)}".lstrip("; ")
