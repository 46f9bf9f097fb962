"""The reference models' dimensions, from the registry; no MindSpore import."""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.models import ModelSpec

FLOAT32_BYTES = 4


@dataclass(frozen=True, slots=True)
class Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mla: bool
    kv_lora_rank: int
    rope_dim: int

    @property
    def slot_elems(self) -> int:
        """Cache elements per token per layer."""
        if self.mla:
            return self.kv_lora_rank + self.rope_dim
        return 2 * self.kv_heads * self.head_dim

    @classmethod
    def of(cls, spec: ModelSpec) -> Dims:
        mla = spec.attention == "mla"
        return cls(layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads,
                   kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   intermediate=spec.intermediate_size, vocab=spec.vocab_size, mla=mla,
                   kv_lora_rank=spec.kv_lora_rank or 0, rope_dim=spec.qk_rope_head_dim or 0)

    def param_count(self) -> int:
        """Parameters of the network as built below (the registry's total_params)."""
        q_dim = self.heads * self.head_dim
        per_layer = 2 * self.hidden * q_dim + 3 * self.hidden * self.intermediate
        if self.mla:
            nope = self.head_dim - self.rope_dim
            per_layer += self.hidden * self.slot_elems
            per_layer += self.kv_lora_rank * self.heads * (nope + self.head_dim)
        else:
            per_layer += self.hidden * self.slot_elems
        return 2 * self.vocab * self.hidden + self.layers * per_layer

    def kv_bytes_per_token(self) -> int:
        """What the network's cache holds per token (float32), all layers."""
        return self.layers * self.slot_elems * FLOAT32_BYTES
