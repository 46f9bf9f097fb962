"""report.json as pretuner wrote it before schema 2 (one schema per method), upgraded to the one
record (pure: dicts in, the schema-2 dict out). What the old files did not say is filled as the
old readers assumed it (kv dtype auto, one node, the model's own weights format, the bytes per
token from the KV math)."""

from __future__ import annotations

from typing import Any

from pretuner.derivation_text import server_args
from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import resolve

_HEAD = ("pretuner_version", "run_id", "simulated", "model", "model_arg", "card_gib", "tp",
         "pp", "validated", "launches", "steps", "decisions")
_FAILURE = ("error", "hint", "exit_code", "error_type", "server_log")
_R01_DEVICE = {"sim": "emulated", "mindspore-cpu": "cpu"}  # else an Ascend card


def upgrade(d: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 report.json (r0.1 or V1, finished or failed) as schema 2."""
    out = _v1(d) if d.get("method") == "v1-pinned-kv" else _r01(d)
    if "error" in d:
        out |= {k: d.get(k) for k in _FAILURE}
        out["method"] = d.get("method", "r0.1")
        out.pop("final", None)
        out.pop("derivation", None)
    if d.get("cluster") is not None:
        out["cluster"] = d["cluster"]
    return out


def _head(d: dict[str, Any], **fields: Any) -> dict[str, Any]:
    head = {"schema_version": 2, **{k: d[k] for k in _HEAD if k in d}, **fields}
    # Steps before the device sampler and Ray had no such keys.
    head["steps"] = [{"worst_node": None, "device_reader": None, "device_peaks_mib": {}} | s
                     for s in d.get("steps", [])]
    head.setdefault("validated", False)
    head.setdefault("launches", len(d.get("steps", [])))
    head["retune_command"] = d.get("retune_command", [])
    return head


def _r01(d: dict[str, Any]) -> dict[str, Any]:
    backend = str(d["backend"])
    prov = d.get("provenance") or {}
    out = _head(
        d, engine=backend, engine_version=None, engine_reason=f"--backend {backend}",
        provenance=prov.get("actual_peak_mib") or ("simulated" if d["simulated"] else "measured"),
        card_source=d.get("card_source", "given"), device_kind=_R01_DEVICE.get(backend, "ascend"),
        nodes=d.get("nodes", 1), weights_format=d["weights_format"],
        kv_cache_dtype=d.get("kv_cache_dtype", "auto"), kv_bytes_per_token=d["kv_bytes_per_token"],
    )
    if "final" not in d:
        return out
    old, deriv = d["final"], d["derivation"]
    values = old["flags"]
    flags = server_args(values)
    out["final"] = {
        "env": old["env"], "flags": flags, "serve_command": [*old["serve_command"], *flags],
        "engine_serve_command": None, "notes": [], "max_model_len": values["max_model_len"],
        "max_num_seqs": values["max_num_seqs"],
        "max_num_batched_tokens": values["max_num_batched_tokens"],
        "kv_tokens": d["max_kv_tokens"], "kv_gib": d["max_kv_gib"],
    }
    out["derivation"] = {
        "method": "r0.1", **deriv,
        "headroom_total_gib": deriv.get("headroom_total_gib", deriv["headroom_gib"]),
        "util": values["gpu_memory_utilization"], "lines": [], "memory_rows": [],
    }
    return out | _asked(d, values["max_model_len"], None)


def _asked(d: dict[str, Any], max_model_len: int, max_num_seqs: int | None) -> dict[str, Any]:
    return {"asked": d.get("asked") or {"max_model_len": max_model_len,
                                        "max_num_seqs": max_num_seqs},
            "given_up": d.get("given_up", [])}


def _v1(d: dict[str, Any]) -> dict[str, Any]:
    spec = resolve(d["model"])
    weights = d.get("weights") or {}
    steps = d.get("steps") or [{}]
    dtype = steps[-1].get("settings", {}).get("kv_cache_dtype", "auto")
    fmt = weights.get("loaded_as") if weights.get("quantization") else None
    out = _head(
        d, engine=d["engine"], engine_version=d.get("engine_version"),
        engine_reason=d["engine_reason"],
        provenance="simulated" if d["simulated"] else "measured", card_source="given",
        device_kind=d.get("device_kind", "cuda"), nodes=1,
        weights_format=fmt or spec.weights_format(None).name, kv_cache_dtype=dtype,
        kv_bytes_per_token=kv_bytes_per_token(spec, tp=d["tp"], pp=d["pp"], kv_dtype=dtype),
    )
    if "final" not in d:
        return out
    f = d["final"]
    out["final"] = {
        "env": f["env"], "flags": f["flags"], "serve_command": f["serve_command"],
        "engine_serve_command": f.get("engine_serve_command"), "notes": f.get("notes", []),
        "max_model_len": f["max_model_len"], "max_num_seqs": f["max_num_seqs"],
        "max_num_batched_tokens": f["max_num_batched_tokens"], "kv_tokens": f["kv_tokens"],
        "kv_gib": f["kv_cache_gib"],
    }
    out["derivation"] = {
        "method": "v1-pinned-kv", "measured_by": d["measured_by"],
        "kv_cache_memory_bytes": f["kv_cache_memory_bytes"], "baseline": d["baseline"],
        "budget": d.get("derivation"),
        **{k: d.get(k) for k in ("memory", "images", "soak", "weights", "speed",
                                 "min_tokens_per_s")},
    }
    return out | _asked(d, f["max_model_len"], f["max_num_seqs"])
