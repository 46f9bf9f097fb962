"""A V1 engine run's record as a preset: the KV cache pinned with `--kv-cache-memory-bytes`,
and the server command the run proved (pure)."""

from __future__ import annotations

from typing import Any

from pretuner.engines.vllm_v1 import ROWS
from pretuner.errors import BadInputError
from pretuner.report.records import PinnedDerivation, RunReport
from pretuner.units import GIB


def flag_value(flags: list[str], name: str) -> str | None:
    """The value after `name` in a flat argv (`--name value` or `--name=value`); None if absent."""
    for i, token in enumerate(flags):
        if token == name and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            return flags[i + 1]
        if token.startswith(name + "="):
            return token.partition("=")[2]
    return None


def split_command(command: list[str], flags: list[str]) -> tuple[list[str], str]:
    """(the command before the model, the model) of `[*command, model, *flags]`."""
    n = len(flags)
    if len(command) < n + 2 or command[len(command) - n :] != flags:
        raise BadInputError(
            "the run record's server command does not end with its flags",
            hint="pass a run folder written by `pretuner run --engine ...`",
        )
    return command[: -n - 1], command[-n - 1]


def pinned_fields(rep: RunReport, d: PinnedDerivation) -> dict[str, Any]:
    """A V1 run's preset fields (`presets.model.preset_from_report` adds what every run has).

    A simulated run's own serve command starts the emulated server; the preset keeps the real
    engine's command with the same flags (`final.engine_serve_command`)."""
    f, engine = rep.final, rep.engine
    command = f.engine_serve_command if rep.simulated else None
    server_command, model_path = split_command(command or f.serve_command, f.flags)
    if engine not in ROWS:
        raise BadInputError(
            f"run engine {engine!r} is not a V1 engine", hint=f"V1 engines: {', '.join(ROWS)}"
        )
    if d.kv_cache_memory_bytes is None:
        raise BadInputError("the V1 run record pinned no KV cache",
                            hint="pass a finished run folder")
    flags: dict[str, int | float] = {
        "max_model_len": f.max_model_len,
        "max_num_seqs": f.max_num_seqs,
        "max_num_batched_tokens": f.max_num_batched_tokens,
        "block_size": int(flag_value(f.flags, "--block-size") or ROWS[engine].default_block_size),
    }
    util = flag_value(f.flags, "--gpu-memory-utilization")
    if util is not None:
        flags["gpu_memory_utilization"] = float(util)
    notes = ["validated under full load" if rep.validated else "NOT validated"]
    if rep.simulated:
        notes.append(
            "figures simulated on the emulated card; the server command is the "
            f"real {engine}'s with the run's flags"
        )
    return {
        "model_path": model_path, "cards_per_node": rep.tp * rep.pp // rep.nodes,
        "engine": engine, "engine_version": rep.engine_version, "flags": flags,
        "kv_gib": round(d.kv_cache_memory_bytes / GIB, 2),
        "notes": "; ".join(notes), "figures": _figures(d),
        "kv_cache_memory_bytes": d.kv_cache_memory_bytes, "server_command": server_command,
        "server_flags": list(f.flags),
    }


def _figures(d: PinnedDerivation) -> dict[str, float]:
    """The derivation's figures (MiB), the engine's own profiled KV tokens, the validation's
    speed and the weights offloaded, when present."""
    out: dict[str, float] = {}
    if d.budget is not None:
        b = d.budget
        out |= {"device_total_mib": b.device_total_mib, "device_peak_mib": b.device_peak_mib,
                "non_kv_peak_mib": b.non_kv_peak_mib, "margin_mib": b.margin_mib}
    if d.baseline.kv_tokens is not None:
        out["profiled_kv_tokens"] = float(d.baseline.kv_tokens)
    if d.speed is not None:
        if d.speed.decode_tokens_per_s is not None:
            out["decode_tokens_per_s"] = d.speed.decode_tokens_per_s
        out["ttft_s"] = d.speed.ttft_s
    if d.weights is not None and d.weights.cpu_offload_gib:
        out["cpu_offload_gib"] = d.weights.cpu_offload_gib
    return out
