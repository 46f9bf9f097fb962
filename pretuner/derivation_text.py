"""The r0.1 method's result as text: its derivation as lines a person reads (`analyze`, `run`,
report.md), and the tuned environment and server flags as a file a shell can `source`."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping

from pretuner.method import Derivation, FinalConfig
from pretuner.units import GIB, MIB


def derivation_lines(
    d: Derivation, *, card_source: str = "given", provenance: str = "measured"
) -> list[str]:
    """Every step of seed 003 §3.2.2 with its formula, value, unit and provenance."""
    i = d.inputs
    peak_gib = d.actual_peak_bytes / GIB
    f = d.final
    final_cap = i.card_gib * f.gpu_memory_utilization
    rows = [
        ("1. KV cache in the pre-run", f"{i.card_gib} GiB x {i.util} - {i.model_use_gib} GiB",
         f"{d.kv_prerun_gib:.2f} GiB"),
        ("2. weights + activations", f"{peak_gib:.2f} GiB peak - {d.kv_prerun_gib:.2f} GiB",
         f"{d.weights_act_gib:.2f} GiB"),
        (f"3. max KV cache (card x final util {f.gpu_memory_utilization})",
         f"{final_cap:.2f} GiB - {d.weights_act_gib:.2f} GiB", f"{d.max_kv_gib:.2f} GiB"),
        ("4. max tokens",
         f"{d.max_kv_gib:.2f} GiB / {i.kv_bytes_per_token:,} B/token, block {i.block_size}",
         f"{d.max_kv_tokens:,} tokens"),
        ("5. max-num-seqs", f"{d.max_kv_tokens:,} // {i.max_model_len:,}",
         f"{d.max_num_seqs_method}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        f"Derivation (the vLLM-MindSpore pre-run method; card {i.card_gib} GiB {card_source}, "
        f"actual peak {d.actual_peak_bytes // MIB:,} MiB {provenance}, everything below derived):"
    ]
    lines += [f"  {a.ljust(w0)}  = {b.ljust(w1)}  = {c}" for a, b, c in rows]
    lost_tokens = d.rounding_cost_bytes // i.kv_bytes_per_token
    lines += [
        "",
        f"Final configuration (headroom {_headroom(d)}, derived):",
        f"  vLLM_MODEL_MEMORY_USE_GB = ceil({d.weights_act_gib:.2f} + {d.headroom_total_gib:.2f})"
        f" = {f.vllm_model_memory_use_gb} GiB (an integer for r0.1; rounding up costs "
        f"{d.rounding_cost_bytes / GIB:.2f} GiB of KV, about {lost_tokens:,} tokens)",
        f"  KV cache per card = {final_cap:.2f} GiB - {f.vllm_model_memory_use_gb} GiB = "
        f"{f.kv_bytes / GIB:.2f} GiB = {f.kv_tokens:,} tokens -> max-num-seqs "
        f"{f.max_num_seqs} at {f.max_model_len:,} tokens",
        "",
    ]
    lines += [f"  export {k}={v}" for k, v in f.env.items()]
    lines.append(f"  {shlex.join(server_args(f.flags))}")
    return lines


def _headroom(d: Derivation) -> str:
    i = d.inputs
    if not i.per_seq_bytes:
        return f"{i.headroom_gib} GiB"
    return (f"{i.headroom_gib:.3g} GiB + {i.per_seq_bytes / MIB:.1f} MiB per running sequence "
            f"beyond the first = {d.headroom_total_gib:.2f} GiB")


def server_args(flags: Mapping[str, int | float | str]) -> list[str]:
    """`--max-model-len 16384 ...` from the flag dict (underscores become dashes)."""
    args: list[str] = []
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def env_file_text(final: FinalConfig, header: Iterable[str]) -> str:
    """`KEY=value` lines for the two env vars plus PRETUNER_SERVER_ARGS, with a comment header."""
    lines = [f"# {line}" for line in header]
    lines += [f"{key}={shlex.quote(value)}" for key, value in final.env.items()]
    lines.append(f"PRETUNER_SERVER_ARGS={shlex.quote(shlex.join(server_args(final.flags)))}")
    return "\n".join(lines) + "\n"
