"""The figure a run measured for a flag, read from its record (pure).

Every line says its provenance: the run's own ("measured" on a real device, "simulated" on the
emulated card), "derived" from those, or "predicted" from the checkpoint (`plan`).
"""

from __future__ import annotations

from collections.abc import Callable

from pretuner import noise
from pretuner.explain.flags import FLAGS
from pretuner.presets.model import config_entries
from pretuner.report.records import (
    PinnedDerivation,
    R01Derivation,
    RunReport,
    V1Weights,
    boots_words,
)

DEFAULT_SWAP_GIB = 4.0


def _pinned(rep: RunReport) -> PinnedDerivation | None:
    return rep.derivation if isinstance(rep.derivation, PinnedDerivation) else None


def _weights(rep: RunReport) -> V1Weights | None:
    d = _pinned(rep)
    return d.weights if d is not None else None


def _speed(rep: RunReport) -> str | None:
    d = _pinned(rep)
    s = d.speed if d is not None else None
    if s is None or s.decode_tokens_per_s is None:
        return None
    return (f"decode {s.decode_tokens_per_s:.2f} tokens/s for one sequence, first token "
            f"after {s.ttft_s:.2f} s for a {s.prompt_tokens:,}-token prompt ({rep.provenance})")


def _offload(rep: RunReport) -> list[str]:
    w, tag = _weights(rep), rep.provenance
    if w is None or not w.cpu_offload_gib:
        return ["not given: every weight stays on the card"]
    lines = [f"--cpu-offload-gb {w.cpu_offload_gib:g}: {w.offloaded_gib_per_card:.2f} GiB "
             f"of the {w.loaded_gib_per_card:.2f} GiB of weights per card in host memory, "
             f"{w.card_weights_gib:.2f} GiB left on the card (predicted)"]
    if w.card_weights_log_gib is not None:
        lines.append(f"the engine loaded {w.card_weights_log_gib:.2f} GiB of weights on the "
                     f"card ({tag}, its 'Model loading took' line)")
    if w.host_available_gib is not None:
        lines.append(f"host: {w.host_offload_gib:.2f} GiB pinned for it, of "
                     f"{w.host_available_gib:.2f} GiB available ({w.host_provenance})")
    return lines + [s for s in (_speed(rep),) if s]


def _swap(rep: RunReport) -> list[str]:
    w = _weights(rep)
    given = w.swap_space_gib if w is not None else None
    value = DEFAULT_SWAP_GIB if given is None else given
    source = "given" if given is not None else "the engine's default"
    line = (f"--swap-space {value:g} GiB per GPU ({source}); V1 engine: checked against the "
            "host at start-up, holds no KV")
    if w is not None and w.host_total_gib:
        line += (f"; {w.host_swap_gib:.2f} GiB of the host's {w.host_total_gib:.2f} GiB "
                 f"= {w.host_swap_gib / w.host_total_gib:.1%} (refused above 70 %, "
                 f"{w.host_provenance})")
    return [line]


def _kv(rep: RunReport) -> list[str]:
    f, d = rep.final, _pinned(rep)
    if d is None:
        return ["this run did not pin its KV cache (r0.1: model-use sizes it)"]
    lines = [f"--kv-cache-memory-bytes {d.kv_cache_memory_bytes} "
             f"({f.kv_gib:.2f} GiB, derived) = {f.kv_tokens or 0:,} KV tokens "
             f"({rep.provenance}), proven under the worst-case load" if rep.validated else
             f"--kv-cache-memory-bytes {d.kv_cache_memory_bytes} (NOT validated)"]
    return lines + (list(d.budget.lines) if d.budget is not None else [])


def _util(rep: RunReport) -> list[str]:
    d = rep.derivation
    if isinstance(d, R01Derivation):
        return [f"--gpu-memory-utilization {d.util} (r0.1: the pool cap)"]
    base = d.baseline
    if not base.kv_tokens:
        return ["the pre-run did not profile at a util (one sequence's KV was pinned)"]
    gain = base.kv_tokens_gain
    return [f"the engine's own profiling at util {base.util} gave {base.kv_tokens:,} KV "
            f"tokens ({rep.provenance})" + (f"; the pinned KV holds {gain:.3f}x that"
                                            if gain else "")]


def _batched(rep: RunReport) -> list[str]:
    line = f"--max-num-batched-tokens {rep.final.max_num_batched_tokens:,}"
    d = _pinned(rep)
    if d is not None and d.budget is not None:
        line += (f"; the non-KV peak with its steps: {d.budget.non_kv_peak_mib:,.1f} MiB "
                 f"({rep.provenance} peak less the KV held, derived)")
    return [line]


def _eager(rep: RunReport) -> list[str]:
    w = _weights(rep)
    out = ["given: no CUDA-graph pool on the card" if w is not None and w.enforce_eager else
           "not given: CUDA graphs captured (their pool is in the non-KV peak)"]
    return out + [s for s in (_speed(rep),) if s]


def _quant(rep: RunReport) -> list[str]:
    w = _weights(rep)
    if w is None:
        return ["no weights block in this run record"]
    lines = [f"{w.quantization or 'not given'}: the linear layers load as "
             f"{w.loaded_as}, {w.loaded_gib_per_card:.2f} GiB per card (predicted)"]
    if w.card_weights_log_gib is not None:
        lines.append(f"the engine loaded {w.card_weights_log_gib:.2f} GiB of weights on the "
                     f"card ({rep.provenance})")
    return lines


def _len(rep: RunReport) -> list[str]:
    mml, tokens = rep.final.max_model_len, rep.final.kv_tokens
    line = f"--max-model-len {mml:,}"
    if tokens:
        line += f"; the KV cache holds {tokens:,} tokens = {tokens / mml:.2f} such sequences"
    return [line + f" ({rep.provenance})"]


def _seqs(rep: RunReport) -> list[str]:
    return [f"--max-num-seqs {rep.final.max_num_seqs}"]


def _dtype(rep: RunReport) -> list[str]:
    return [f"--kv-cache-dtype {config_entries(rep.final.flags).get('kv-cache-dtype', 'auto')}"]


def _r01(var: str) -> Measure:
    def lines(rep: RunReport) -> list[str]:
        env, d = rep.final.env, rep.derivation
        if var not in env:
            return [f"{var} is vLLM-MindSpore r0.1's: this run's engine does not read it"]
        out = [f"{var}={env[var]}"]
        if var.startswith("vLLM_MODEL") and isinstance(d, R01Derivation):
            out.append(f"weights + activations {d.weights_act_gib:.2f} GiB (derived from "
                       f"'actual peak used' {d.actual_peak_mib:,}M, {rep.provenance})")
        return out
    return lines


def _boots(rep: RunReport) -> list[str]:
    words = boots_words(rep)
    if words is not None:
        return [words]
    d = _pinned(rep)
    total = d.budget.device_total_mib if d is not None and d.budget is not None else None
    return ["proven on one boot: the headroom floor applies"
            + (f", {noise.floor_words(total)}" if total is not None else "")]


Measure = Callable[[RunReport], list[str]]
MEASURED: dict[str, Measure] = {
    "--cpu-offload-gb": _offload, "--swap-space": _swap, "--kv-cache-memory-bytes": _kv,
    "--gpu-memory-utilization": _util, "--max-num-batched-tokens": _batched,
    "--enforce-eager": _eager, "--quantization": _quant, "--max-model-len": _len,
    "--max-num-seqs": _seqs, "--kv-cache-dtype": _dtype, "--repeat-proof": _boots,
    "ASCEND_TOTAL_MEMORY_GB": _r01("ASCEND_TOTAL_MEMORY_GB"),
    "vLLM_MODEL_MEMORY_USE_GB": _r01("vLLM_MODEL_MEMORY_USE_GB"),
}


def report_section(rep: RunReport) -> list[str]:
    """report.md's "What these flags do": each memory flag of the run's final command, what
    it really does, and this run's figure beside it."""
    flags = rep.final.flags
    shown = [d for d in FLAGS if d.name.startswith("--") and (
        d.name in flags or d.name in ("--gpu-memory-utilization", "--swap-space"))]
    lines = ["## What these flags do", ""]
    for doc in shown:
        figures = MEASURED[doc.name](rep)
        # The KV's derivation has its own section: its first line is the figure.
        figure = "; ".join(figures[:1] if doc.name == "--kv-cache-memory-bytes" else figures)
        lines.append(f"- `{doc.name}`: {doc.summary}. {doc.not_this} Here: {figure}.")
    lines += ["", "`pretuner explain FLAG --run RUN` says more about each.", ""]
    return lines
