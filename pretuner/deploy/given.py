"""A preset from values a user tuned by hand (`pretuner script --model M --card ...`), its KV
figures from pretuner's own math with r0.1's budget card*util - model-use (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token, kv_tokens
from pretuner.models import local_model_path, resolve
from pretuner.presets.model import (
    KvBasis,
    Preset,
    PresetKind,
    model_use_budget_bytes,
    preset_name,
)
from pretuner.units import GIB


@dataclass(frozen=True, slots=True)
class GivenValues:
    """The settings a user deployed with, as typed on the command line."""

    model: str  # registry name, alias, HF id or a local model folder
    card_gib: int
    tp: int
    util: float
    model_use_gib: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    pp: int = 1
    nodes: int = 1
    kv_cache_dtype: str = "auto"
    weights_format: str | None = None  # None: the model's usual format


def preset_from_values(v: GivenValues) -> Preset:
    """The preset the scripts render from, with its KV figures checked against the math."""
    for flag, value in (
        ("--card", v.card_gib),
        ("--tp", v.tp),
        ("--pp", v.pp),
        ("--nodes", v.nodes),
        ("--model-use-gb", v.model_use_gib),
        ("--max-model-len", v.max_model_len),
        ("--max-num-seqs", v.max_num_seqs),
        ("--max-num-batched-tokens", v.max_num_batched_tokens),
        ("--block-size", v.block_size),
    ):
        if value < 1:
            raise BadInputError(f"{flag} {value} is invalid",
                                hint="use a whole number of 1 or more")
    if not 0 < v.util <= 1:
        raise BadInputError(f"--util {v.util:g} is invalid", hint="use a value in (0, 1]")
    cards = v.tp * v.pp
    if cards % v.nodes:
        raise BadInputError(
            f"TP{v.tp} x PP{v.pp} = {cards} cards do not split evenly over {v.nodes} node(s)",
            hint="give --nodes that divides tp x pp",
        )
    spec = resolve(v.model)
    fmt = spec.weights_format(v.weights_format).name
    bpt = kv_bytes_per_token(spec, tp=v.tp, pp=v.pp, kv_dtype=v.kv_cache_dtype)
    cap_gib = v.card_gib * v.util
    if v.model_use_gib >= cap_gib:
        raise BadInputError(
            f"--model-use-gb {v.model_use_gib} leaves no KV cache: card x util = "
            f"{v.card_gib} x {v.util:g} = {cap_gib:.2f} GiB",
            hint=f"use a model-use below {cap_gib:.2f} GiB, or a higher --util",
        )
    budget = model_use_budget_bytes(v.card_gib, v.util, v.model_use_gib)
    tokens = kv_tokens(budget, bpt, v.block_size)
    kv_text = (
        f"the KV cache holds {tokens:,} tokens per card ({budget / GIB:.2f} GiB at {bpt:,} B/token)"
    )
    if v.max_model_len > tokens:
        raise BadInputError(
            f"--max-model-len {v.max_model_len:,} does not fit: {kv_text}",
            hint=f"the most that fits is {tokens:,}; lower it or --model-use-gb",
        )
    if v.max_num_batched_tokens > tokens:
        raise BadInputError(
            f"--max-num-batched-tokens {v.max_num_batched_tokens:,} does not fit: {kv_text}",
            hint=f"the most that fits is {tokens:,}",
        )
    notes = ""
    full = tokens // v.max_model_len
    if v.max_num_seqs > full:
        # Not refused: deployments set max-num-seqs above this on purpose (the DeepSeek-R1
        # production scripts run 192 with room for 3), counting on most requests being short.
        notes = (
            f"max-num-seqs {v.max_num_seqs} x max-model-len {v.max_model_len:,} = "
            f"{v.max_num_seqs * v.max_model_len:,} tokens exceed the KV cache ({tokens:,} tokens "
            f"per card): at most {full} full-length sequence(s) fit at once; the rest wait or "
            "are preempted"
        )
    model_path = local_model_path(v.model) or spec.hf_id  # a folder by its absolute path
    name = f"{spec.name}-tp{v.tp}-{v.card_gib}g-given"
    return Preset(
        name=preset_name(name), kind=PresetKind.GIVEN,
        model=spec.name, model_path=model_path, card_gib=v.card_gib, tp=v.tp, pp=v.pp,
        nodes=v.nodes, cards_per_node=cards // v.nodes, weights_format=fmt,
        kv_cache_dtype=v.kv_cache_dtype, engine="vllm-mindspore", engine_version="0.1",
        env={"ASCEND_TOTAL_MEMORY_GB": str(v.card_gib),
             "vLLM_MODEL_MEMORY_USE_GB": str(v.model_use_gib)},
        flags={"max_model_len": v.max_model_len, "max_num_seqs": v.max_num_seqs,
               "max_num_batched_tokens": v.max_num_batched_tokens,
               "gpu_memory_utilization": v.util, "block_size": v.block_size},
        kv_bytes_per_token=bpt, kv_basis=KvBasis.MODEL_USE, kv_gib=round(budget / GIB, 2),
        kv_tokens=tokens, date="-",
        source=(
            f"values given on the command line: card {v.card_gib} GiB, util {v.util:g}, "
            f"model-use {v.model_use_gib} GiB, max-model-len {v.max_model_len}, "
            f"max-num-seqs {v.max_num_seqs}, max-num-batched-tokens "
            f"{v.max_num_batched_tokens}, block {v.block_size}, kv dtype {v.kv_cache_dtype}"
        ),
        notes=notes,
    )
