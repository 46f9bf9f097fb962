"""The V1 server flags that decide where the weights live and how a step runs, fixed for a run:
`--quantization`, `--cpu-offload-gb`, `--swap-space`, `--enforce-eager`.

They do not change between launches (the loop varies only the KV cache), so the engine adds
them to every launch and to the deployed command as they were given (pure data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pretuner.engines.base import Flag

# vLLM's own default of --swap-space (GiB per GPU), used when the flag is not given.
VLLM_DEFAULT_SWAP_GIB = 4.0


def gib_text(value: float) -> str:
    """A GiB figure as a flag value: `20`, `0.5`."""
    return f"{value:g}"


@dataclass(frozen=True, slots=True)
class Knobs:
    """What a run was told about quantization, offload, swap and CUDA graphs."""

    quantization: str | None = None  # vLLM's --quantization name; None: as stored
    cpu_offload_gib: float = 0.0  # --cpu-offload-gb per card; 0: every weight on the card
    swap_space_gib: float | None = None  # --swap-space per card; None: the engine's default
    enforce_eager: bool = False  # --enforce-eager: no CUDA graphs (no graph pool, slower)

    @property
    def active(self) -> bool:
        return bool(self.quantization or self.cpu_offload_gib or self.swap_space_gib is not None
                    or self.enforce_eager)

    @property
    def swap_gib(self) -> float:
        """The swap space the engine will check against the host (its default when not given)."""
        return VLLM_DEFAULT_SWAP_GIB if self.swap_space_gib is None else self.swap_space_gib

    def flags(self) -> tuple[Flag, ...]:
        """The server flags, in vLLM's spelling; none for a knob left at its default."""
        out: list[Flag] = []
        if self.quantization:
            out.append(("--quantization", self.quantization))
        if self.cpu_offload_gib:
            out.append(("--cpu-offload-gb", gib_text(self.cpu_offload_gib)))
        if self.swap_space_gib is not None:
            out.append(("--swap-space", gib_text(self.swap_space_gib)))
        if self.enforce_eager:
            out.append(("--enforce-eager", None))
        return tuple(out)

    def words(self) -> str:
        """One line for a summary: what the run loads and how."""
        parts = [name if value is None else f"{name} {value}" for name, value in self.flags()]
        return ", ".join(parts if self.quantization else ["weights as stored", *parts])

    def to_json(self) -> dict[str, Any]:
        return {"quantization": self.quantization, "cpu_offload_gib": self.cpu_offload_gib,
                "swap_space_gib": self.swap_space_gib, "enforce_eager": self.enforce_eager}

