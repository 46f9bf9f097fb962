"""How the emulated engines lay out their KV cache: a page per attention layer, summed per block.

Pure. Written apart from the tuner's KV arithmetic on purpose: the emulator grades the tuner,
and a grader that shares the code under test cannot catch a fault in it
(`tests/test_sim_independent.py` checks both agree and that nothing here imports the tuner).
Full attention keeps a key and a value plane of the rank's KV heads; MLA keeps the latent and
the rope key on every rank; the pipeline stage with the most layers decides the block size."""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.models.spec import ModelSpec
from pretuner.sim.argv import Refused

# Element sizes in bytes by the names the emulated servers and model configs use.
_ELEMENT_BYTES = {
    "float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2,
    "int8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
_ROPE_DTYPE_OF_INT8_MLA = "bf16"  # MindSpore leaves the rope key unquantized


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What one rank of the busiest pipeline stage keeps per token."""

    slot_bytes: int  # one token's slot in one layer: the layer's planes (every layer has the same)
    layers: int  # attention layers on the busiest stage

    def block_bytes(self, block_size: int) -> int:
        """One block across every layer of the stage (a page of `block_size` slots per layer):
        the unit the engine allocates."""
        return self.layers * block_size * self.slot_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes(1)


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """The layers of each pipeline stage, split as vLLM's `get_pp_indices` does."""
    if pp < 1:
        raise Refused("ValueError", f"pipeline_parallel_size ({pp}) must be positive")
    if pp > num_layers:
        raise Refused("ValueError", f"pipeline_parallel_size ({pp}) is larger than the "
                      f"number of hidden layers ({num_layers})")
    split = [num_layers // pp] * pp
    for back in range(2, num_layers % pp + 2):
        split[-back] += 1
    return tuple(split)


def rank_kv_heads(total_kv_heads: int, tp: int) -> int:
    """The KV heads one tensor-parallel rank holds (QKVParallelLinear's split or replication)."""
    if tp >= total_kv_heads:
        if tp % total_kv_heads:
            raise Refused("AssertionError", f"{tp} is not divisible by {total_kv_heads}")
        return 1
    if total_kv_heads % tp:
        raise Refused("AssertionError", f"{total_kv_heads} is not divisible by {tp}")
    return total_kv_heads // tp


def element_bytes(spec: ModelSpec, cache_dtype: str) -> int:
    name = spec.dtype if cache_dtype == "auto" else cache_dtype
    if name not in _ELEMENT_BYTES:
        raise Refused("ValueError", f"Unknown kv cache dtype: {name}")
    return _ELEMENT_BYTES[name]


def slot_bytes(spec: ModelSpec, *, tp: int, cache_dtype: str) -> int:
    """What one token keeps in one layer on one tensor-parallel rank: the sum of its planes."""
    if tp < 1:
        raise Refused("ValueError", f"tensor_parallel_size ({tp}) must be positive")
    elem = element_bytes(spec, cache_dtype)
    if spec.kv_lora_rank is not None:  # vLLM's use_mla: the config carries a latent rank
        if spec.qk_rope_head_dim is None:
            raise Refused("ValueError", f"{spec.name}: an MLA config needs "
                          "qk_rope_head_dim beside kv_lora_rank")
        # Every rank keeps the whole latent and the rope key: TP does not enter.
        rope = _ELEMENT_BYTES[_ROPE_DTYPE_OF_INT8_MLA] if cache_dtype == "int8" else elem
        return spec.kv_lora_rank * elem + spec.qk_rope_head_dim * rope
    # A key and a value plane of the rank's KV heads.
    return 2 * rank_kv_heads(spec.num_kv_heads, tp) * spec.head_dim * elem


def cache_layout(spec: ModelSpec, *, tp: int = 1, pp: int = 1,
                 cache_dtype: str = "auto") -> CacheLayout:
    """The KV cache of one rank on the busiest stage; raises `Refused` as the engine
    would refuse the layout."""
    slot = slot_bytes(spec, tp=tp, cache_dtype=cache_dtype)
    return CacheLayout(slot, max(stage_layers(spec.num_layers, pp)))
