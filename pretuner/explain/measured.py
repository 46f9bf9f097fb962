"""The figure a run measured for a flag, read from its report.json (pure).

Every line says its provenance: the run's own ("measured" on a real device, "simulated" on the
emulated card), "derived" from those, or "predicted" from the checkpoint (`plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretuner.explain.flags import FLAGS, FlagDoc

DEFAULT_SWAP_GIB = 4.0


def _flag(flags: list[str], name: str) -> str | None:
    for i, word in enumerate(flags):
        if word == name:
            nxt = flags[i + 1] if i + 1 < len(flags) else None
            return nxt if nxt is not None and not nxt.startswith("--") else "on"
    return None


def _speed(rep: dict[str, Any], tag: str) -> str | None:
    speed = rep.get("speed")
    if not isinstance(speed, dict) or speed.get("decode_tokens_per_s") is None:
        return None
    return (f"decode {speed['decode_tokens_per_s']:.2f} tokens/s for one sequence, first token "
            f"after {speed['ttft_s']:.2f} s for a {speed['prompt_tokens']:,}-token prompt "
            f"({tag})")


def _offload(rep: dict[str, Any], tag: str) -> list[str]:
    w = rep.get("weights") or {}
    if not w.get("cpu_offload_gib"):
        return ["not given: every weight stays on the card"]
    lines = [f"--cpu-offload-gb {w['cpu_offload_gib']:g}: {w['offloaded_gib_per_card']:.2f} GiB "
             f"of the {w['loaded_gib_per_card']:.2f} GiB of weights per card in host memory, "
             f"{w['card_weights_gib']:.2f} GiB left on the card (predicted)"]
    if w.get("card_weights_log_gib") is not None:
        lines.append(f"the engine loaded {w['card_weights_log_gib']:.2f} GiB of weights on the "
                     f"card ({tag}, its 'Model loading took' line)")
    if w.get("host_available_gib") is not None:
        lines.append(f"host: {w['host_offload_gib']:.2f} GiB pinned for it, of "
                     f"{w['host_available_gib']:.2f} GiB available ({w['host_provenance']})")
    return lines + [s for s in (_speed(rep, tag),) if s]


def _swap(rep: dict[str, Any], tag: str) -> list[str]:
    w = rep.get("weights") or {}
    given = w.get("swap_space_gib")
    value = DEFAULT_SWAP_GIB if given is None else given
    source = "given" if given is not None else "the engine's default"
    line = (f"--swap-space {value:g} GiB per GPU ({source}); V1 engine: checked against the "
            "host at start-up, holds no KV")
    if w.get("host_total_gib"):
        line += (f"; {w['host_swap_gib']:.2f} GiB of the host's {w['host_total_gib']:.2f} GiB "
                 f"= {w['host_swap_gib'] / w['host_total_gib']:.1%} (refused above 70 %, "
                 f"{w['host_provenance']})")
    return [line]


def _kv(rep: dict[str, Any], tag: str) -> list[str]:
    f = rep["final"]
    lines = [f"--kv-cache-memory-bytes {f['kv_cache_memory_bytes']} "
             f"({f['kv_cache_gib']:.2f} GiB, derived) = {f.get('kv_tokens') or 0:,} KV tokens "
             f"({tag}), proven under the worst-case load" if rep.get("validated") else
             f"--kv-cache-memory-bytes {f['kv_cache_memory_bytes']} (NOT validated)"]
    d = rep.get("derivation")
    if d:
        lines += list(d["lines"])
    return lines


def _util(rep: dict[str, Any], tag: str) -> list[str]:
    if rep.get("method") != "v1-pinned-kv":
        f = rep.get("final", {}).get("flags", {})
        return [f"--gpu-memory-utilization {f.get('gpu_memory_utilization')} (r0.1: the pool "
                "cap)"]
    base = rep.get("baseline") or {}
    if not base.get("kv_tokens"):
        return ["the pre-run did not profile at a util (one sequence's KV was pinned)"]
    gain = base.get("kv_tokens_gain")
    return [f"the engine's own profiling at util {base['util']} gave {base['kv_tokens']:,} KV "
            f"tokens ({tag})" + (f"; the pinned KV holds {gain:.3f}x that" if gain else "")]


def _batched(rep: dict[str, Any], tag: str) -> list[str]:
    f = rep["final"]
    line = f"--max-num-batched-tokens {f['max_num_batched_tokens']:,}"
    d = rep.get("derivation")
    if d:
        line += (f"; the non-KV peak with its steps: {d['non_kv_peak_mib']:,.1f} MiB ({tag} "
                 "peak less the KV held, derived)")
    return [line]


def _eager(rep: dict[str, Any], tag: str) -> list[str]:
    on = bool((rep.get("weights") or {}).get("enforce_eager"))
    out = ["given: no CUDA-graph pool on the card" if on else
           "not given: CUDA graphs captured (their pool is in the non-KV peak)"]
    return out + [s for s in (_speed(rep, tag),) if s]


def _quant(rep: dict[str, Any], tag: str) -> list[str]:
    w = rep.get("weights") or {}
    if not w:
        return ["no weights block in this run record"]
    lines = [f"{w.get('quantization') or 'not given'}: the linear layers load as "
             f"{w['loaded_as']}, {w['loaded_gib_per_card']:.2f} GiB per card (predicted)"]
    if w.get("card_weights_log_gib") is not None:
        lines.append(f"the engine loaded {w['card_weights_log_gib']:.2f} GiB of weights on the "
                     f"card ({tag})")
    return lines


def _len(rep: dict[str, Any], tag: str) -> list[str]:
    f = rep["final"]
    mml = f["max_model_len"]
    tokens = f.get("kv_tokens") or f.get("max_kv_tokens") or rep.get("max_kv_tokens")
    line = f"--max-model-len {mml:,}"
    if tokens:
        line += f"; the KV cache holds {tokens:,} tokens = {tokens / mml:.2f} such sequences"
    return [line + f" ({tag})"]


def _seqs(rep: dict[str, Any], tag: str) -> list[str]:
    f = rep["final"]
    seqs = f.get("max_num_seqs") or f.get("flags", {}).get("max_num_seqs")
    return [f"--max-num-seqs {seqs}"]


def _dtype(rep: dict[str, Any], tag: str) -> list[str]:
    flags = rep["final"].get("flags")
    value = _flag(flags, "--kv-cache-dtype") if isinstance(flags, list) else None
    return [f"--kv-cache-dtype {value or 'auto'}"]


def _r01(var: str) -> Measure:
    def lines(rep: dict[str, Any], tag: str) -> list[str]:
        env = rep.get("final", {}).get("env", {})
        if var not in env:
            return [f"{var} is vLLM-MindSpore r0.1's: this run's engine does not read it"]
        out = [f"{var}={env[var]}"]
        d = rep.get("derivation") or {}
        if var.startswith("vLLM_MODEL") and d.get("weights_act_gib") is not None:
            out.append(f"weights + activations {d['weights_act_gib']:.2f} GiB (derived from "
                       f"'actual peak used' {d['actual_peak_mib']:,}M, {tag})")
        return out
    return lines


Measure = Callable[[dict[str, Any], str], list[str]]
MEASURED: dict[str, Measure] = {
    "--cpu-offload-gb": _offload, "--swap-space": _swap, "--kv-cache-memory-bytes": _kv,
    "--gpu-memory-utilization": _util, "--max-num-batched-tokens": _batched,
    "--enforce-eager": _eager, "--quantization": _quant, "--max-model-len": _len,
    "--max-num-seqs": _seqs, "--kv-cache-dtype": _dtype,
    "ASCEND_TOTAL_MEMORY_GB": _r01("ASCEND_TOTAL_MEMORY_GB"),
    "vLLM_MODEL_MEMORY_USE_GB": _r01("vLLM_MODEL_MEMORY_USE_GB"),
}


def tag_of(rep: dict[str, Any]) -> str:
    prov = rep.get("provenance")
    if isinstance(prov, dict):
        prov = prov.get("actual_peak_mib")
    return str(prov or "measured")


def measured_lines(doc: FlagDoc, rep: dict[str, Any]) -> list[str]:
    """What this run shows of `doc`'s flag."""
    try:
        return MEASURED[doc.name](rep, tag_of(rep))
    except (KeyError, TypeError, ValueError):
        return ["this run record does not carry that figure"]


def report_section(rep: dict[str, Any]) -> list[str]:
    """report.md's "What these flags do": each memory flag of the run's final command, what
    it really does, and this run's figure beside it."""
    flags = [str(f) for f in rep["final"]["flags"]]
    shown = [d for d in FLAGS if d.name.startswith("--") and (
        d.name in flags or d.name in ("--gpu-memory-utilization", "--swap-space"))]
    lines = ["## What these flags do", ""]
    for doc in shown:
        figures = measured_lines(doc, rep)
        # The KV's derivation has its own section: its first line is the figure.
        figure = "; ".join(figures[:1] if doc.name == "--kv-cache-memory-bytes" else figures)
        lines.append(f"- `{doc.name}`: {doc.summary}. {doc.not_this} Here: {figure}.")
    lines += ["", "`pretuner explain FLAG --run RUN` says more about each.", ""]
    return lines
