"""A V1 engine run's report.json as a preset: the KV cache pinned with
`--kv-cache-memory-bytes`, and the server command the run proved (pure)."""

from __future__ import annotations

import re
from typing import Any

from pretuner.engines.vllm_v1 import ROWS
from pretuner.errors import BadInputError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import resolve
from pretuner.presets.model import KvBasis, Preset, PresetKind
from pretuner.units import GIB

# The server's --kv-cache-dtype back to pretuner's name (kvmath.KV_DTYPES); no flag: "auto".
_KV_DTYPE = {"int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


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


def preset_from_v1_report(rep: dict[str, Any], *, name: str | None, date: str) -> Preset:
    """A V1 run record as a pinned preset (measured, or simulated on the emulated card).

    A simulated run's own serve command starts the emulated server; the preset keeps the real
    engine's command with the same flags (`final.engine_serve_command`)."""
    try:
        final = rep["final"]
        engine = rep["engine"]
        flags = [str(f) for f in final["flags"]]
        simulated = bool(rep["simulated"])
        command = final.get("engine_serve_command") if simulated else None
        server_command, model_path = split_command(
            [str(c) for c in command or final["serve_command"]], flags
        )
        if engine not in ROWS:
            raise BadInputError(
                f"run engine {engine!r} is not a V1 engine", hint=f"V1 engines: {', '.join(ROWS)}"
            )
        tp, pp = int(rep["tp"]), int(rep["pp"])
        nodes = int(rep.get("nodes", 1))
        spec = resolve(rep["model"])
        block = int(
            rep.get("block_size")
            or flag_value(flags, "--block-size")
            or ROWS[engine].default_block_size
        )
        dtype = rep.get("kv_cache_dtype") or _KV_DTYPE.get(
            flag_value(flags, "--kv-cache-dtype") or "", "auto"
        )
        bpt = int(
            rep.get("kv_bytes_per_token") or kv_bytes_per_token(spec, tp=tp, pp=pp, kv_dtype=dtype)
        )
        kv_bytes = int(final["kv_cache_memory_bytes"])
        num_flags: dict[str, int | float] = {
            "max_model_len": int(final["max_model_len"]),
            "max_num_seqs": int(final["max_num_seqs"]),
            "max_num_batched_tokens": int(final["max_num_batched_tokens"]),
            "block_size": block,
        }
        util = flag_value(flags, "--gpu-memory-utilization")
        if util is not None:
            num_flags["gpu_memory_utilization"] = float(util)
        kind = PresetKind.SIMULATED if simulated else PresetKind.MEASURED
        default = f"{spec.name}-tp{tp}-{rep['card_gib']}g-{engine}-{kind.value}-{rep['run_id']}"
        notes = ["validated under full load" if rep["validated"] else "NOT validated"]
        if simulated:
            notes.append(
                "figures simulated on the emulated card; the server command is the "
                f"real {engine}'s with the run's flags"
            )
        return Preset(
            name=name or re.sub(r"[^a-z0-9.-]+", "-", default.lower()).strip("-"),
            kind=kind,
            model=spec.name,
            model_path=model_path,
            card_gib=int(rep["card_gib"]),
            tp=tp,
            pp=pp,
            nodes=nodes,
            cards_per_node=tp * pp // nodes,
            weights_format=rep.get("weights_format") or _loaded_as(rep)
            or spec.weights_format(None).name,
            kv_cache_dtype=dtype,
            engine=engine,
            engine_version=rep.get("engine_version"),
            env={str(k): str(v) for k, v in final["env"].items()},
            flags=num_flags,
            kv_bytes_per_token=bpt,
            kv_basis=KvBasis.PINNED,
            kv_gib=round(kv_bytes / GIB, 2),
            kv_tokens=int(final["kv_tokens"]),
            date=date,
            source=f"pretuner {rep['pretuner_version']} run {rep['run_id']} "
            f"({'emulated card' if simulated else engine})",
            notes="; ".join(notes),
            run_id=rep["run_id"],
            figures=_figures(rep),
            kv_cache_memory_bytes=kv_bytes,
            server_command=server_command,
            server_flags=flags,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise BadInputError(
            f"the V1 run record lacks {err} in report.json", hint="pass a finished run folder"
        ) from None


def _figures(rep: dict[str, Any]) -> dict[str, float]:
    """The derivation's figures (MiB) and the engine's own profiled KV tokens, when present."""
    d = rep.get("derivation") or {}
    keys = ("device_total_mib", "device_peak_mib", "non_kv_peak_mib", "margin_mib")
    out = {k: float(d[k]) for k in keys if d.get(k) is not None}
    profiled = (rep.get("baseline") or {}).get("kv_tokens")
    if profiled is not None:
        out["profiled_kv_tokens"] = float(profiled)
    speed = rep.get("speed") or {}
    for key in ("decode_tokens_per_s", "ttft_s"):  # what the validation measured
        if speed.get(key) is not None:
            out[key] = float(speed[key])
    offload = (rep.get("weights") or {}).get("cpu_offload_gib")
    if offload:
        out["cpu_offload_gib"] = float(offload)
    return out


def _loaded_as(rep: dict[str, Any]) -> str | None:
    """A run that quantized its weights: the format they loaded as (bitsandbytes-nf4-dq)."""
    weights = rep.get("weights") or {}
    return str(weights["loaded_as"]) if weights.get("quantization") else None
