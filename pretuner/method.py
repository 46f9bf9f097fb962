"""The documented pre-run method (seed 003 §3.2.2) as pure arithmetic, every step with units.

Given what a pre-run measured (the worst rank's `actual peak used`), derive how much of the
card the weights and activations need, how much KV cache the rest buys, and the final
configuration. GiB are 1024-based; MindSpore's `M` is MiB and its "GB" is GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretuner import validate as v
from pretuner.errors import BadInputError, InfeasibleError
from pretuner.kvmath import kv_tokens, num_kv_blocks
from pretuner.units import GIB, MIB

# Headroom added to the measured weights+activations before it becomes
# vLLM_MODEL_MEMORY_USE_GB. A pre-run measures one max-length prefill; under full load the
# pool also holds what a single request does not show: sampler and logits buffers for every
# running sequence (max_num_seqs x vocab x fp32, a few copies: ~0.1 GiB for DeepSeek-V3 at
# 33 sequences), decode-step workspace, and fragmentation from many sequences allocating and
# freeing blocks at once. 0.5 GiB covers those on a 64 GB card while costing under 1.5% of a
# typical 36 GiB KV cache. docs/method.md "Headroom" says more; `--headroom-gb` changes it.
DEFAULT_HEADROOM_GIB = 0.5
# What each running sequence adds that a one-request pre-run cannot show: the sampler's fp32
# logits, probabilities and log-probabilities over the vocabulary, plus block tables, decode
# buffers and the pool's per-allocation fragments (an estimate: 4 MiB; a validation that
# runs out of memory replaces the whole per-sequence figure by what it measured).
SAMPLER_COPIES = 3
PER_SEQ_FIXED_BYTES = 4 * MIB


def per_sequence_bytes(vocab_size: int) -> int:
    """Headroom each running sequence needs on top of the measured pre-run (see above)."""
    return SAMPLER_COPIES * vocab_size * 4 + PER_SEQ_FIXED_BYTES


@dataclass(frozen=True, slots=True)
class PrerunInputs:
    """What the method needs: the pre-run's settings and the worst rank's measured peak."""

    card_gib: int
    util: float
    model_use_gib: int
    actual_peak_mib: int
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    max_num_batched_tokens: int | None = None  # default: max_model_len, what the pre-run used
    final_util: float | None = None  # default: util; issue the tuned config at another util
    per_seq_bytes: int = 0  # headroom per running sequence (per_sequence_bytes(vocab))
    # vLLM V0 keeps int(watermark x blocks) KV blocks free: a max-length sequence is admitted
    # only beside them, so max-num-seqs counts the blocks above the watermark.
    watermark: float = 0.0


@dataclass(frozen=True, slots=True)
class FinalConfig:
    """The configuration to start production with, and the KV cache it gives per card."""

    ascend_total_memory_gb: int
    vllm_model_memory_use_gb: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_bytes: int
    kv_tokens: int

    @property
    def chunked_prefill(self) -> bool:
        return self.max_num_batched_tokens < self.max_model_len

    @property
    def env(self) -> dict[str, str]:
        return {
            "ASCEND_TOTAL_MEMORY_GB": str(self.ascend_total_memory_gb),
            "vLLM_MODEL_MEMORY_USE_GB": str(self.vllm_model_memory_use_gb),
        }

    @property
    def flags(self) -> dict[str, int | float]:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "block_size": self.block_size,
        }


@dataclass(frozen=True, slots=True)
class Derivation:
    """Every step of seed 003 §3.2.2, then the final configuration."""

    inputs: PrerunInputs
    kv_prerun_bytes: int  # step 1: the KV cache the pre-run allocated (whole blocks)
    actual_peak_bytes: int
    weights_act_bytes: int  # step 2: actual peak - pre-run KV
    max_kv_bytes: int  # step 3: card*util - weights+act
    max_kv_tokens: int  # step 4: block-floored tokens in max_kv
    max_num_seqs_method: int  # step 5: max_kv_tokens // max_model_len
    headroom_total_gib: float  # headroom_gib + per_seq_bytes x (max-num-seqs - 1)
    model_use_exact_gib: float  # weights+act + headroom, before rounding up
    rounding_cost_bytes: int  # KV lost by rounding the model-use budget up to an integer
    final: FinalConfig

    @property
    def kv_prerun_gib(self) -> float:
        return self.kv_prerun_bytes / GIB

    @property
    def weights_act_gib(self) -> float:
        return self.weights_act_bytes / GIB

    @property
    def max_kv_gib(self) -> float:
        return self.max_kv_bytes / GIB

    @property
    def max_num_seqs(self) -> int:
        return self.final.max_num_seqs


# A sanity cap: the validation launch sends this many max-length requests at once, and no
# server batches more (vLLM's default is 256). Without it, a card size the server does not
# enforce (--card 1000000000) derives hundreds of millions of sequences and the load hangs.
MAX_NUM_SEQS = 1024


def check_launch_settings(card_gib: int, util: float, model_use_gib: int) -> None:
    """The rules r0.1 enforces at start, as one-line errors naming the value and the fix."""
    v.layout(card_gib, util, None, None, None, None)  # the card and util as a user gives them
    if model_use_gib < 1:
        raise BadInputError(f"model-use budget {model_use_gib} GiB is invalid", hint="use e.g. 50")
    if model_use_gib >= card_gib * util:
        raise BadInputError(
            f"model-use {model_use_gib} GiB >= card*util = {card_gib * util:.2f} GiB leaves no KV "
            "cache (r0.1 computes negative blocks)",
            hint=f"use a model-use below {card_gib * util:.2f} GiB or a higher --util",
        )


def derive(inp: PrerunInputs) -> Derivation:
    """Apply the method to one pre-run's measurement."""
    check_launch_settings(inp.card_gib, inp.util, inp.model_use_gib)
    if inp.max_model_len < 1:
        raise BadInputError(
            f"--max-model-len {inp.max_model_len} is invalid", hint="use e.g. 16384"
        )
    if inp.actual_peak_mib < 1:
        raise BadInputError(f"actual peak {inp.actual_peak_mib} MiB is invalid")
    if inp.headroom_gib < 0:
        raise BadInputError(f"headroom {inp.headroom_gib} GiB is negative", hint="use 0 or more")
    final_util = inp.util if inp.final_util is None else inp.final_util
    if not 0 < final_util <= 1:
        raise BadInputError(f"final util {final_util} is outside (0, 1]")
    bpt, block = inp.kv_bytes_per_token, inp.block_size

    # Step 1: what r0.1 allocated for KV in the pre-run (it allocates whole blocks).
    prerun_budget = int(inp.card_gib * GIB * inp.util) - inp.model_use_gib * GIB
    kv_prerun = num_kv_blocks(prerun_budget, bpt, block) * block * bpt
    # Step 2: the pool's peak includes the KV cache; the rest is weights + activations.
    peak = inp.actual_peak_mib * MIB
    weights_act = peak - kv_prerun
    if weights_act <= 0:
        raise BadInputError(
            f"actual peak {inp.actual_peak_mib} MiB is not above the pre-run's KV cache "
            f"{kv_prerun / MIB:,.0f} MiB",
            hint="the log does not match these settings: check --card, --util and --model-use-gb",
        )
    # Steps 3-5, as the seed does them (no headroom, no rounding).
    cap = int(inp.card_gib * GIB * final_util)
    max_kv = cap - weights_act
    if max_kv <= 0:
        raise InfeasibleError(
            f"weights+activations need {weights_act / GIB:.2f} GiB, more than card*util = "
            f"{cap / GIB:.2f} GiB",
            hint="use more cards (--tp), a quantized checkpoint, or a shorter --max-model-len",
        )
    max_tokens = kv_tokens(max_kv, bpt, block)
    seqs_method = max_tokens // inp.max_model_len

    # Final: the model-use budget must be an integer (r0.1 parses it with int()), and it holds
    # the per-sequence headroom of every sequence served. The smallest integer that holds
    # weights+activations and the base headroom leaves the most KV; when its room cannot hold
    # the per-sequence headroom of every sequence that KV serves, max-num-seqs is capped there,
    # unless more GiB of room serve more sequences (the KV cache's count only falls as the
    # budget grows, so the search stops where it can no longer beat the best).
    base_use = math.ceil(weights_act / GIB + inp.headroom_gib - 1e-9)
    best: tuple[int, int, int] | None = None  # (seqs, -model_use, model_use)
    for use in range(base_use, max(base_use, cap // GIB) + 1):
        kv_blocks = num_kv_blocks(cap - use * GIB, bpt, block)
        kv_seqs = max_num_seqs(kv_blocks, block, inp.max_model_len, inp.watermark)
        if best is not None and kv_seqs <= best[0]:
            break
        if inp.per_seq_bytes:  # the pre-run ran one sequence: the others add headroom
            room = use * GIB - weights_act - int(inp.headroom_gib * GIB)
            kv_seqs = min(kv_seqs, 1 + room // inp.per_seq_bytes) if room >= 0 else 0
        if kv_seqs >= 1 and (best is None or kv_seqs > best[0]):
            best = (kv_seqs, -use, use)
    model_use = best[2] if best else base_use
    final_seqs = best[0] if best else 0
    headroom = inp.headroom_gib + max(0, final_seqs - 1) * inp.per_seq_bytes / GIB
    exact = weights_act / GIB + headroom
    rounding_cost = max(0, int((model_use - exact) * GIB))
    final_kv_budget = cap - model_use * GIB
    final_tokens = kv_tokens(final_kv_budget, bpt, block)
    final_kv = num_kv_blocks(final_kv_budget, bpt, block) * block * bpt
    if model_use >= inp.card_gib * final_util or final_seqs < 1:
        raise InfeasibleError(
            f"at --max-model-len {inp.max_model_len:,} the KV cache left after weights+activations "
            f"({weights_act / GIB:.2f} GiB + {headroom:.2f} GiB headroom) holds "
            f"{final_tokens:,} tokens, not one sequence"
            + (f" beside the engine's {inp.watermark:.0%} block watermark" if inp.watermark
               else ""),
            hint=(
                f"a max-model-len of at most {final_tokens:,} would fit one sequence; or add cards"
                if final_tokens
                else "add cards (--tp) or use a quantized checkpoint"
            ),
        )
    batched = inp.max_num_batched_tokens or inp.max_model_len
    if batched > final_tokens:
        raise InfeasibleError(
            f"--max-num-batched-tokens {batched:,} exceeds the {final_tokens:,} tokens the KV "
            "cache holds",
            hint=f"use at most {final_tokens:,}",
        )
    final = FinalConfig(
        ascend_total_memory_gb=inp.card_gib, vllm_model_memory_use_gb=model_use,
        gpu_memory_utilization=final_util, max_model_len=inp.max_model_len, max_num_seqs=final_seqs,
        max_num_batched_tokens=batched, block_size=block, kv_bytes=final_kv, kv_tokens=final_tokens,
    )
    return Derivation(
        inputs=inp, kv_prerun_bytes=kv_prerun, actual_peak_bytes=peak,
        weights_act_bytes=weights_act, max_kv_bytes=max_kv, max_kv_tokens=max_tokens,
        max_num_seqs_method=seqs_method, headroom_total_gib=headroom, model_use_exact_gib=exact,
        rounding_cost_bytes=rounding_cost, final=final,
    )


def max_num_seqs(blocks: int, block_size: int, max_model_len: int, watermark: float) -> int:
    """Max-length sequences `blocks` KV blocks serve at once beside the engine's watermark."""
    usable = blocks - int(watermark * blocks)
    return min(MAX_NUM_SEQS, max(0, usable // -(-max_model_len // block_size)))
