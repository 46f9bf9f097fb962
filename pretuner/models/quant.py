"""Quantized weights as the engine will load them: bytes per parameter, and what stays 16-bit.

A quantized checkpoint (or vLLM's in-flight `--quantization`) converts the linear layers of the
decoder; embeddings, lm_head, norms and MoE routers stay in the model dtype. Per parameter of a
converted linear layer:

- fp8 (e4m3): 1 B, plus one fp32 scale per weight block when `weight_block_size` is set
  (DeepSeek-V3, Qwen3-FP8: 128 x 128 blocks, + 4 / 16384 B); per-tensor scales are negligible.
- AWQ / GPTQ, b bits, group g: b/8 B packed, plus per group an fp16 scale (2 B) and a b-bit
  packed zero point: + (2 + b/8) / g B (4-bit g128: 0.5 + 2.5/128 = 0.5195 B). GPTQ's g_idx
  (one int32 per input row) is under 0.1% and ignored.
- bitsandbytes 4-bit (nf4/fp4, QLoRA paper arXiv:2305.14314): 0.5 B, plus an absmax per block
  of 64: fp32 (+ 4/64 B) or, double-quantized, int8 with one fp32 per 256 absmax
  (+ 1/64 + 4/(64*256) B). vLLM's in-flight bitsandbytes quantization is 4-bit
  (BitsAndBytesConfig defaults load_in_4bit=True, load_in_8bit=False; vLLM docs, "Inflight
  quantization: load as 4bit"); its loader quantizes nf4 with compress_statistics (double
  quantization), as recalled from vllm/model_executor/model_loader/bitsandbytes_loader.py.
  8-bit comes only from a pre-quantized checkpoint whose config says load_in_8bit.
- bitsandbytes 8-bit (LLM.int8()): 1 B plus one fp32 scale per output row (negligible).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pretuner.errors import BadInputError

if TYPE_CHECKING:
    from pretuner.models.spec import ModelSpec

# What `plan --quantization` accepts: vLLM's names for the methods it quantizes in flight
# (bitsandbytes, fp8) or loads from a pre-quantized checkpoint (awq, gptq).
METHODS = ("bitsandbytes", "fp8", "awq", "gptq")
BNB_BLOCK = 64
BNB_DQ_GROUP = 256  # absmax values per fp32 second-level constant (double quantization)
FROM_CONFIG = "config.json quantization_config"


@dataclass(frozen=True, slots=True)
class Quantization:
    """How the linear layers of the decoder are stored on the card."""

    method: str  # fp8, awq, gptq, bitsandbytes, compressed-tensors
    bits: int
    group_size: int | None = None  # None: per-channel/per-tensor scales (negligible)
    double_quant: bool = False  # bitsandbytes 4-bit only
    block_elems: int | None = None  # fp8 block quantization: elements per fp32 scale
    skipped: tuple[str, ...] = ()  # modules_to_not_convert / ignore, as the config lists them
    source: str = "--quantization"  # or FROM_CONFIG

    @property
    def name(self) -> str:
        if self.method == "bitsandbytes":
            kind = "nf4" if self.bits == 4 else "int8"
            return f"bitsandbytes-{kind}{'-dq' if self.double_quant else ''}"
        group = f"-g{self.group_size}" if self.group_size else ""
        return f"{self.method}-{self.bits}bit{group}"

    @property
    def linear_bytes_per_param(self) -> float:
        """Bytes one converted linear-layer parameter takes, scales and zero points included."""
        base = self.bits / 8
        if self.method == "bitsandbytes":
            if self.bits != 4:
                return base
            if self.double_quant:
                return base + 1 / BNB_BLOCK + 4 / (BNB_BLOCK * BNB_DQ_GROUP)
            return base + 4 / BNB_BLOCK
        if self.method == "fp8":
            return base + (4 / self.block_elems if self.block_elems else 0.0)
        if self.group_size:
            return base + (2 + base) / self.group_size
        return base


@dataclass(frozen=True, slots=True)
class ParamSplit:
    """A model's parameters: the decoder's linear layers, and the rest (kept 16-bit)."""

    linear_params: int
    other_params: int
    how: str


def param_split(spec: ModelSpec) -> ParamSplit:
    """Linear-in-decoder parameters vs embeddings, lm_head, norms and routers."""
    # The registry's w8a8 derivation where a model has one (linear layers at 1 B, the rest at
    # the dtype's bytes: linear = (native - w8a8) / (dtype_bytes - 1)); else the rest counted
    # from the dims (untied embeddings and lm_head, two norms per layer and a final one, a
    # router per MoE layer) and the linear layers as what is left.
    native = spec.weights_format(None)
    dtype_b = spec.dtype_bytes
    w8a8 = next((f for f in spec.weights if f.name.lower() == "w8a8"), None)
    if w8a8 is not None and native.name != w8a8.name and dtype_b > 1:
        linear = (native.total_bytes - w8a8.total_bytes) // (dtype_b - 1)
        if 0 < linear <= spec.total_params:
            return ParamSplit(linear, spec.total_params - linear, "registry w8a8 derivation")
    h, layers = spec.hidden_size, spec.num_layers
    rest = 2 * spec.vocab_size * h + (2 * layers + 1) * h + spec.num_experts * h * layers
    rest = min(rest, spec.total_params)
    return ParamSplit(spec.total_params - rest, rest, "model dims")


def quantized_bytes(spec: ModelSpec, quant: Quantization) -> int:
    """Weights bytes of the whole model loaded with `quant` (all cards together)."""
    split = param_split(spec)
    linear = split.linear_params * quant.linear_bytes_per_param
    return round(linear + split.other_params * spec.dtype_bytes)


def from_flag(method: str) -> Quantization:
    """`--quantization NAME` on an unquantized checkpoint: what vLLM quantizes in flight."""
    name = method.strip().lower()
    if name == "bitsandbytes":
        return Quantization("bitsandbytes", 4, double_quant=True)
    if name == "fp8":
        return Quantization("fp8", 8)
    if name in ("awq", "gptq"):
        # vLLM cannot quantize these in flight; sized as the usual 4-bit, group-128 export.
        return Quantization(name, 4, group_size=128)
    raise BadInputError(f"--quantization {method!r} is not supported by plan",
                        hint=f"choose one of: {', '.join(METHODS)}")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _compressed_tensors(q: dict[str, Any], skipped: tuple[str, ...]) -> Quantization | None:
    """The first config group's weights scheme (simple, single-scheme checkpoints)."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    first = next(iter(groups.values()))
    weights = first.get("weights") if isinstance(first, dict) else None
    if not isinstance(weights, dict):
        return None
    bits = _int(weights.get("num_bits")) or 8
    group = _int(weights.get("group_size")) if weights.get("strategy") == "group" else None
    method = "fp8" if weights.get("type") == "float" and bits == 8 else "compressed-tensors"
    return Quantization(method, bits, group_size=group, skipped=skipped, source=FROM_CONFIG)


def from_config(cfg: dict[str, Any]) -> Quantization | None:
    """The `quantization_config` of a Hugging Face config.json, or None when absent/unknown."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    raw_skip = (q.get("modules_to_not_convert") or q.get("ignore")
                or q.get("llm_int8_skip_modules") or ())
    skipped = tuple(str(m) for m in raw_skip) if isinstance(raw_skip, list) else ()
    src = FROM_CONFIG
    if method == "fp8":
        block = q.get("weight_block_size")
        elems = (block[0] * block[1] if isinstance(block, list) and len(block) == 2
                 and all(_int(b) for b in block) else None)
        return Quantization("fp8", 8, block_elems=elems, skipped=skipped, source=src)
    if method in ("awq", "gptq"):
        bits = _int(q.get("bits") or q.get("w_bit")) or 4
        group = _int(q.get("group_size") or q.get("q_group_size"))
        return Quantization(method, bits, group_size=group, skipped=skipped, source=src)
    if method == "bitsandbytes":
        bits = 8 if q.get("load_in_8bit") else 4
        dq = bool(q.get("bnb_4bit_use_double_quant")) and bits == 4
        return Quantization("bitsandbytes", bits, double_quant=dq, skipped=skipped, source=src)
    if method == "compressed-tensors":
        return _compressed_tensors(q, skipped)
    return None
