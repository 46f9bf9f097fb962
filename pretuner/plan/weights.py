"""Weights as loaded (quantized, offloaded) and the host memory that offload and swap cost.

vLLM's `--cpu-offload-gb X` keeps X GiB of each card's weights in pinned host memory and streams
them to the card on every forward pass (memory bought with speed); `--swap-space Y` reserves
Y GiB of host memory per card for the KV blocks of preempted sequences. Neither is card memory.

Only the decoder layers' weights can go to the host: vLLM wraps the layers it builds in a loop
with its offloader, while the token embedding and the lm_head stay on the card (as recalled
from vllm/model_executor/models/utils.py, `make_layers` and `maybe_offload_to_cpu`). So an
offload larger than the layers (the field note's 60 GiB for 37 GiB of 4-bit weights) moves
the layers and no more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pretuner.errors import BadInputError
from pretuner.models.quant import Quantization, param_split, quantized_bytes
from pretuner.models.spec import ModelSpec
from pretuner.units import GIB

if TYPE_CHECKING:
    from pretuner.plan.layout import PlanConfig

IN_FLIGHT = ("bitsandbytes", "fp8")  # what vLLM quantizes while loading a 16-bit checkpoint


def loaded(
    spec: ModelSpec, weights_format: str | None, quant: Quantization | None
) -> tuple[int, Quantization | None]:
    """Total weights bytes as the engine loads them, and the quantization that applies."""
    fmt = spec.weights_format(weights_format)
    if spec.quantization is not None:  # a pre-quantized checkpoint: its size is measured
        if quant is not None and quant.method != spec.quantization.method:
            raise BadInputError(
                f"--quantization {quant.method}: {spec.name} is already quantized with "
                f"{spec.quantization.method} (its config.json quantization_config)",
                hint=f"drop --quantization or pass --quantization {spec.quantization.method}",
            )
        return fmt.total_bytes, spec.quantization
    if quant is None:
        return fmt.total_bytes, None
    if quant.method not in IN_FLIGHT:
        raise BadInputError(
            f"--quantization {quant.method} loads a checkpoint exported as {quant.method}; "
            f"{spec.name} has no quantization_config (vLLM quantizes while loading only with "
            f"{' or '.join(IN_FLIGHT)})",
            hint=f"use --quantization bitsandbytes, or --model a {quant.method} checkpoint folder",
        )
    native = spec.weights_format(None).name
    if weights_format is not None and weights_format.lower() not in (native, "bf16", "fp16"):
        raise BadInputError(
            f"--quantization {quant.method} quantizes the {native} checkpoint; "
            f"--weights-format {weights_format} is already quantized",
            hint="drop one of --quantization and --weights-format",
        )
    return quantized_bytes(spec, quant), quant


@dataclass(frozen=True, slots=True)
class WeightsPlan:
    """Per card: the weights as loaded, what offload moves to the host, and the host's bill."""

    quantization: str | None  # None: the checkpoint as stored
    quant_source: str
    linear_params: int
    other_params: int
    linear_bytes_per_param: float | None
    other_dtype: str
    loaded_bytes_per_card: int
    offload_bytes_per_card: int
    swap_bytes_per_card: int
    cards: int
    host_cards: int  # the cards one host carries (the busiest node's): its host memory bill
    engine: str | None
    skipped_modules: int
    host_available_bytes: int | None = None  # measured by the CLI (/proc/meminfo)
    headroom_gib: float = 0.0

    @property
    def card_weights_bytes(self) -> int:
        return self.loaded_bytes_per_card - self.offload_bytes_per_card

    @property
    def host_bytes(self) -> int:
        return (self.offload_bytes_per_card + self.swap_bytes_per_card) * self.host_cards

    @property
    def host_fits(self) -> bool | None:
        if self.host_available_bytes is None:
            return None
        return self.host_bytes <= self.host_available_bytes

    @property
    def active(self) -> bool:
        """Whether the plan text shows this block (existing invocations print as before)."""
        return bool(self.quantization or self.offload_bytes_per_card or self.swap_bytes_per_card
                    or self.engine)

    def to_json(self) -> dict[str, Any]:
        per_param = self.linear_bytes_per_param
        available = self.host_available_bytes
        return {
            "quantization": self.quantization, "quantization_source": self.quant_source,
            "linear_params": self.linear_params, "other_params": self.other_params,
            "linear_bytes_per_param": round(per_param, 4) if per_param else None,
            "loaded_gib_per_card": round(self.loaded_bytes_per_card / GIB, 3),
            "cpu_offload_gib_per_card": round(self.offload_bytes_per_card / GIB, 3),
            "card_weights_gib": round(self.card_weights_bytes / GIB, 3),
            "swap_space_gib_per_card": round(self.swap_bytes_per_card / GIB, 3),
            "cards": self.cards, "cards_per_host": self.host_cards,
            "host_gib": round(self.host_bytes / GIB, 3),
            "host_available_gib": round(available / GIB, 3) if available is not None else None,
            "host_fits": self.host_fits, "engine": self.engine, "provenance": "predicted",
        }  # fmt: skip


def weights_plan(cfg: PlanConfig, cards: int) -> WeightsPlan:
    total, quant = loaded(cfg.model, cfg.weights_format, cfg.quantization)
    split = param_split(cfg.model)
    # --cpu-offload-gb moves at most the decoder layers' share: the token embedding and the
    # lm_head (untied, as `param_split` counts them, 16-bit) stay on the card.
    embeddings = 2 * cfg.model.vocab_size * cfg.model.hidden_size * cfg.model.dtype_bytes
    layers = max(0, total - embeddings) // cards
    return WeightsPlan(
        quantization=quant.name if quant else None,
        quant_source=quant.source if quant else "checkpoint as stored",
        linear_params=split.linear_params,
        other_params=split.other_params,
        linear_bytes_per_param=quant.linear_bytes_per_param if quant else None,
        other_dtype=cfg.model.dtype,
        loaded_bytes_per_card=total // cards,
        offload_bytes_per_card=min(layers, int(cfg.cpu_offload_gib * GIB)),
        swap_bytes_per_card=int(cfg.swap_space_gib * GIB),
        cards=cards,
        host_cards=min(cards, cfg.cards_per_node),
        engine=cfg.engine,
        skipped_modules=len(quant.skipped) if quant else 0,
        host_available_bytes=cfg.host_available_bytes,
        headroom_gib=cfg.headroom_gib,
    )


def render_weights_plan(wp: WeightsPlan, activation_bytes: int, kv_bytes: int) -> list[str]:
    """The text block `plan` prints when quantization, offload, swap or an engine is named."""
    lines = ["weights as loaded (predicted):"]
    if wp.quantization and wp.linear_bytes_per_param:
        lines.append(f"  {wp.quantization} ({wp.quant_source}): {wp.linear_bytes_per_param:.4f} B "
                     f"per linear-layer param ({wp.linear_params / 1e9:.2f}e9 params); "
                     f"{wp.other_params / 1e9:.2f}e9 params (embeddings, lm_head, norms, "
                     f"routers) stay {wp.other_dtype}")
    else:
        lines.append(f"  unquantized ({wp.quant_source})")
    if wp.skipped_modules:
        lines.append(f"  {wp.skipped_modules} module(s) listed as not converted (kept 16-bit)")
    lines.append(f"  loaded: {wp.loaded_bytes_per_card / GIB:.2f} GiB per card")
    if wp.offload_bytes_per_card:
        lines.append(f"  --cpu-offload-gb: {wp.offload_bytes_per_card / GIB:.2f} GiB of weights "
                     "per card stay in host memory and cross to the card on every forward pass "
                     "(slower decode)")
    runtime = activation_bytes + wp.headroom_gib * GIB
    lines.append(f"  per card: weights {wp.card_weights_bytes / GIB:.2f} GiB, KV "
                 f"{kv_bytes / GIB:.2f} GiB, runtime {runtime / GIB:.2f} GiB (activation + "
                 f"{wp.headroom_gib:g} GiB headroom)")
    each = " on each node" if wp.cards > wp.host_cards else ""
    host = (f"  host memory: {wp.offload_bytes_per_card / GIB:.2f} GiB offload + "
            f"{wp.swap_bytes_per_card / GIB:.2f} GiB swap per card x {wp.host_cards} card(s) = "
            f"{wp.host_bytes / GIB:.2f} GiB{each}")
    if wp.host_available_bytes is not None:
        host += (f"; host has {wp.host_available_bytes / GIB:.2f} GiB available "
                 "(measured, /proc/meminfo MemAvailable)")
    lines.append(host)
    if wp.host_fits is False:
        lines.append("  warning: the host does not have that much memory available; lower "
                     "--cpu-offload-gb/--swap-space or free host memory")
    return lines
