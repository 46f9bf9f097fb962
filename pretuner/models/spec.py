"""What the memory math needs to know about a model: its shape and its checkpoint sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pretuner.errors import BadInputError
from pretuner.models.quant import Quantization
from pretuner.models.vision import VisionSpec


class AttentionKind(str, Enum):
    """How a layer stores its KV cache."""

    MHA = "mha"  # kv_heads == heads
    GQA = "gqa"  # 1 < kv_heads < heads
    MQA = "mqa"  # kv_heads == 1
    MLA = "mla"  # DeepSeek latent cache: kv_lora_rank + qk_rope_head_dim per layer, not sharded


DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1,
    "fp8_e4m3": 1, "fp8_e5m2": 1,
}  # fmt: skip
# A compute dtype's name as a checkpoint format: the native weights of a bfloat16 model are bf16.
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True, slots=True)
class WeightsFormat:
    """One checkpoint format users deploy (bf16, W8A8, fp8...) and its total size on disk."""

    name: str
    total_bytes: int
    source: str = "derived"  # "measured" (checkpoint index), "derived" (params x bytes/param)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's dimensions, as far as the KV and weight arithmetic needs them."""

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    attention: AttentionKind
    total_params: int
    dtype: str
    weights: tuple[WeightsFormat, ...]
    max_position_embeddings: int
    aliases: tuple[str, ...] = ()
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0  # the experts a token is routed to (MoE)
    moe_intermediate_size: int | None = None  # one expert's width; None: intermediate_size
    active_params: int | None = None
    default_weights: str | None = None  # the format users deploy on Ascend when not told
    # Models of the CPU reference server (pretuner.sim.mindspore_cpu): attention keeps a
    # (heads, T, T) score matrix instead of a flash kernel's tiles, and there is no device
    # workspace (None: plan's Ascend default).
    eager_attention: bool = False
    workspace_bytes: int | None = None
    notes: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    vision: VisionSpec | None = None  # vision-language models' vision tower; text-only: None
    # A pre-quantized checkpoint's quantization_config (local folders); None: unquantized.
    quantization: Quantization | None = None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def weights_format(self, name: str | None = None) -> WeightsFormat:
        """The named checkpoint format, or the model's native one when `name` is None."""
        if name is None and self.default_weights is not None:
            name = self.default_weights
        if name is None:
            native = SHORT_DTYPE.get(self.dtype, self.dtype)
            return next((f for f in self.weights if f.name == native), self.weights[0])
        for fmt in self.weights:
            if fmt.name.lower() == name.lower():
                return fmt
        choices = ", ".join(f.name for f in self.weights)
        raise BadInputError(
            f"model {self.name} has no weights format {name!r}", hint=f"choose one of: {choices}"
        )
