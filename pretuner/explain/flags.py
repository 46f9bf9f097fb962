"""What each memory flag of the engines really does, in the engine's own terms (pure data).

Written from the engines' behaviour as pretuner models and measures it (vLLM's V1 engine,
vLLM-MindSpore r0.1's variables); a few facts are marked "as recalled" where they come from
reading the engine's source rather than from a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.noise import CAP_FLOOR_MIB, SPREAD_SEEN_MIB


@dataclass(frozen=True, slots=True)
class FlagDoc:
    name: str  # as the engine spells it
    engines: str  # which engines read it
    summary: str  # one line: what it is
    does: tuple[str, ...]  # what it really does to memory and speed
    not_this: str  # the usual misreading, set right


FLAGS: tuple[FlagDoc, ...] = (
    FlagDoc(
        "--cpu-offload-gb", "vLLM V1 (CUDA, vllm-ascend)",
        "moves up to N GiB per GPU of model *weights* to pinned host memory",
        ("The decoder layers' weights are kept in page-locked host memory, up to N GiB per GPU; "
         "the token embedding and the lm_head stay on the card, so an N above the layers' size "
         "moves the layers and no more (as recalled from vLLM's make_layers / "
         "maybe_offload_to_cpu).",
         "The card holds N GiB less of weights, which the engine can give to the KV cache; the "
         "host holds N GiB more per GPU, pinned (the process dies when the host lacks it).",
         "Every forward pass reads the offloaded weights over the host link (PCIe): each engine "
         "step, prefill or one decode token, pays about N GiB / link bandwidth, so decode "
         "slows in proportion to N (0.4 tokens/s in the field note's 60 GiB case)."),
        "It does not move the KV cache to the CPU, and it is not a swap of KV blocks: the KV "
        "cache stays on the card, sized by --gpu-memory-utilization or "
        "--kv-cache-memory-bytes."),
    FlagDoc(
        "--swap-space", "vLLM (V0 and V1), vLLM-MindSpore r0.1 (V0)",
        "host memory per GPU for the KV blocks of preempted sequences (V0 engines)",
        ("On a V0 engine (vLLM before 0.8's default, vLLM-MindSpore r0.1 = vLLM 0.6.6) the "
         "engine allocates N GiB of pinned host memory per GPU as CPU KV blocks ('# CPU "
         "blocks') and swaps out the KV of sequences it preempts when the card's KV cache is "
         "full; single-sequence requests are recomputed instead.",
         "On the V1 engine preemption always recomputes: the space holds no KV blocks, but the "
         "value is still checked against the host's total memory at start-up (N x TP above "
         "70 % of it is refused, above 40 % warned).",
         "It never adds card memory and never changes the KV cache's size on the card."),
        "It is not where offloaded weights go (that is --cpu-offload-gb), and it does not let "
        "a longer --max-model-len fit: one sequence's KV must still fit on the card."),
    FlagDoc(
        "--kv-cache-memory-bytes", "vLLM >= 0.11 (V1), vllm-ascend, vLLM-MindSpore >= 0.5",
        "pins the KV cache's size per GPU, in bytes",
        ("The engine allocates exactly this much KV cache per GPU and skips its memory "
         "profiling: --gpu-memory-utilization no longer sizes the KV cache (vLLM still checks "
         "util x total against the free memory at start-up).",
         "What the profiling would have missed (CUDA-graph capture, the sampler's warm-up, the "
         "per-step workspace of real prefills) must fit beside it: pretuner derives the value "
         "from the device peak it measured and proves it under the worst-case load."),
        "It is not a cap the engine grows into: the bytes are taken at start-up."),
    FlagDoc(
        "--gpu-memory-utilization", "vLLM (V1), vllm-ascend, vLLM-MindSpore (r0.1: caps the pool)",
        "the fraction of the GPU's *total* memory the engine may plan for",
        ("V1: the engine profiles one dummy step of --max-num-batched-tokens tokens, then "
         "gives the KV cache util x total minus what that profile measured (weights, the "
         "step's activations); graph capture, the sampler warm-up and real steps come after "
         "and are not in that figure, so a util close to 1 can die after profiling.",
         "It is a share of the total, not of what is free: with another process on the card, "
         "util x total above the free memory is refused at start-up.",
         "vLLM-MindSpore r0.1: MindSpore's pool is capped at total x util "
         "(max_device_memory), and KV = total x util - vLLM_MODEL_MEMORY_USE_GB."),
        "Lowering it does not free memory for anything else in the process: it shrinks the KV "
        "cache."),
    FlagDoc(
        "--max-num-batched-tokens", "vLLM (V1), vllm-ascend, vLLM-MindSpore",
        "the token budget of one engine step (the largest prefill chunk)",
        ("A long prompt is prefilled in chunks of at most this many tokens (chunked prefill); "
         "a step's activations grow with it, so it sets the peak activation memory and the "
         "size of the profiling's dummy step.",
         "Smaller: less activation memory per step, more steps (slower time to first token) "
         "for a long prompt; it must be at least --max-num-seqs."),
        "It does not limit the prompt length (--max-model-len does) nor the KV cache."),
    FlagDoc(
        "--enforce-eager", "vLLM (V1), vllm-ascend",
        "runs the model without CUDA graphs (and without torch.compile)",
        ("No graph capture at start-up: the graph memory pool ('Graph capturing finished ... "
         "took X GiB') and the capture's scratch are not taken, so the card has that much more "
         "for the KV cache and for a model that barely fits.",
         "Every decode step launches its kernels one by one: small batches decode slower (the "
         "launch cost is paid per layer per step)."),
        "It does not change the weights' or the KV cache's size, only the graph pool."),
    FlagDoc(
        "--quantization", "vLLM (V1), vllm-ascend",
        "how the linear layers' weights are stored on the card",
        ("bitsandbytes quantizes a 16-bit checkpoint to 4-bit NF4 while it loads (about "
         "0.52 B per linear-layer parameter with its scales); fp8 to 8 bit (GPUs of compute "
         "capability 8.0 and above); awq and gptq load a checkpoint exported in that format. "
         "Embeddings, lm_head and norms stay 16-bit.",
         "The weights shrink, and the card has the difference for the KV cache; 4-bit "
         "bitsandbytes kernels dequantize as they multiply, so a step reads fewer bytes but "
         "does more work per byte."),
        "It does not shrink the KV cache: --kv-cache-dtype does."),
    FlagDoc(
        "--max-model-len", "every engine", "the longest request: prompt plus output tokens",
        ("One sequence of this length must fit the KV cache, or the engine refuses to start "
         "(it prints the longest length that would fit).",),
        "It is not how much KV the engine allocates: the KV cache holds many such sequences, "
        "or parts of them."),
    FlagDoc(
        "--max-num-seqs", "every engine", "the most sequences a step runs at once",
        ("The sampler's buffers are sized for it and warmed up at start-up; how many run at "
         "once is also bounded by the KV cache's tokens / their lengths.",),
        "Raising it does not make the KV cache hold more sequences."),
    FlagDoc(
        "--kv-cache-dtype", "vLLM, vllm-ascend, vLLM-MindSpore",
        "the KV cache's element type (auto: the model's dtype)",
        ("fp8 (or int8 on Ascend) halves the KV bytes per token of a 16-bit model: twice the "
         "tokens in the same memory.",),
        "It does not quantize the weights: --quantization does."),
    FlagDoc(
        "ASCEND_TOTAL_MEMORY_GB", "vLLM-MindSpore r0.1 (environment)",
        "the card's physical memory in GB (an integer), as npu-smi shows it",
        ("With --gpu-memory-utilization it sets MindSpore's pool cap (total x util) and the KV "
         "budget; it goes through int(): '64.5' crashes the server.",),
        "It is not what is free: the system and driver keep about 3 GiB of it."),
    FlagDoc(
        "vLLM_MODEL_MEMORY_USE_GB", "vLLM-MindSpore r0.1 (environment)",
        "the GiB r0.1 sets aside for weights, activations and the non-framework part",
        ("KV blocks = floor((total x util - MODEL_USE) GiB / block bytes): every GiB given to "
         "it is a GiB less KV; too little and the warm-up prefill runs out of memory. An "
         "integer (int()).",),
        "It is not measured by the engine: pretuner derives it from the pool dump's "
        "'actual peak used'."),
    FlagDoc(
        "--repeat-proof", "pretuner run, every engine",
        "proves the final configuration on N boots and keeps their peaks' spread as headroom",
        ("The same flags do not peak at the same MiB on every boot: on a real H200 (vLLM "
         "0.24.0, tests/fixtures/real/vllm-0.24-h200-burst) two boots peaked 26 MiB apart "
         f"under the proof load and {SPREAD_SEEN_MIB} MiB apart under a 1,024-wide short burst.",
         "With N > 1 the final configuration is launched N-1 more times; the spread of the proof "
         "peaks (max - min, MiB, measured) is reported, and the headroom kept (device total - "
         "the highest peak; r0.1: the pool cap - the worst rank's peak) is at least that spread, "
         "else the KV is lowered by the difference and proven again, within --max-launches.",
         f"Without it the headroom is a floor, the same on every engine: {SPREAD_SEEN_MIB} MiB, "
         "the largest spread a repeated proof has shown (vLLM V1 on the H200 above; no r0.1 "
         "run has been repeated on a real card, so r0.1, vllm-ascend, vLLM-MindSpore and the "
         f"emulated cards keep the same), never more than max({CAP_FLOOR_MIB} MiB, 1 % of the "
         "card) unless this run's own boots measured more: 256 MiB on a 24 GB card, 500 MiB "
         "on an 80 GB H100 or a 64 GB Ascend card."),
        "It does not add launches by default (N = 1: the pre-run, the proof, and a tightening "
        "that gains at least 2 %)."),
)


def find(name: str) -> FlagDoc | None:
    """The flag by its name, with or without dashes, `_` or `-`, any case for env vars."""
    # The flags' bare names differ, so the bare match is also the exact one.
    bare = name.strip().lstrip("-").replace("_", "-").lower()
    for doc in FLAGS:
        if bare == doc.name.lstrip("-").replace("_", "-").lower():
            return doc
    return None
