"""`pretuner models` and `pretuner models show NAME`: the registry, rendered."""

from __future__ import annotations

from typing import Any

import typer

from pretuner import kvmath
from pretuner.cli.app import Group, app
from pretuner.cli.render import emit, table
from pretuner.errors import BadInputError
from pretuner.models import ModelSpec, builtin_specs, resolve
from pretuner.units import GIB

SHOW_TPS = (1, 2, 4, 8, 16)

models_app = typer.Typer(
    help="List the built-in models, or show one model's dimensions.",
    epilog="""\b
Examples:
  pretuner models
  pretuner models show deepseek-v3 --json
  pretuner models show ./my-hf-folder""",
    add_completion=False,
    rich_markup_mode=None,
    cls=Group,
)
app.add_typer(models_app, name="models", invoke_without_command=True)


@models_app.callback(invoke_without_command=True)
def models_list(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List the built-in models (the same as `pretuner models` with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    specs = builtin_specs()
    rows = [(s.name, s.hf_id, s.attention.value, s.num_layers, f"{s.total_params / 1e9:,.2f}",
             s.dtype, f"{kvmath.kv_bytes_per_token(s):,}") for s in specs]
    headers = ("NAME", "HF ID", "ATTENTION", "LAYERS", "PARAMS (1e9)", "DTYPE",
               "KV BYTES/TOKEN (TP1)")
    emit(as_json, {"models": [_summary_json(s) for s in specs]}, table(headers, rows))


@models_app.command("show")
def models_show(
    name: str = typer.Argument(
        ..., metavar="MODEL", help="Registry name, alias, HF id, or local HF folder."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every field of one model, with units, and its KV bytes per token at TP 1-16."""
    spec = resolve(name)
    kv_valid, kv_invalid = _kv_by_tp(spec)
    emit(as_json, _spec_json(spec, kv_valid, kv_invalid), _spec_text(spec, kv_valid, kv_invalid))


def _kv_by_tp(spec: ModelSpec) -> tuple[dict[int, int], dict[int, str]]:
    """KV bytes per token per card at each shown TP; the reason where a TP is not valid."""
    valid: dict[int, int] = {}
    invalid: dict[int, str] = {}
    for tp in SHOW_TPS:
        try:
            valid[tp] = kvmath.kv_bytes_per_token(spec, tp=tp)
        except BadInputError as err:
            invalid[tp] = err.message
    return valid, invalid


def _summary_json(spec: ModelSpec) -> dict[str, Any]:
    return {"name": spec.name, "hf_id": spec.hf_id, "attention": spec.attention.value,
            "num_layers": spec.num_layers, "total_params": spec.total_params, "dtype": spec.dtype,
            "kv_bytes_per_token_tp1": kvmath.kv_bytes_per_token(spec)}


# `models show --json`: these spec fields as they are, in this order, then the derived ones.
SHOW_FIELDS = (
    "name", "hf_id", "aliases", "attention", "num_layers", "hidden_size", "num_heads",
    "num_kv_heads", "head_dim", "vocab_size", "intermediate_size", "kv_lora_rank",
    "qk_rope_head_dim", "sliding_window", "sliding_window_layers", "num_experts", "total_params",
    "active_params", "dtype", "dtype_bytes", "max_position_embeddings",
)


def _spec_json(
    spec: ModelSpec, kv_valid: dict[int, int], kv_invalid: dict[int, str]
) -> dict[str, Any]:
    data: dict[str, Any] = {name: getattr(spec, name) for name in SHOW_FIELDS}
    data.update(aliases=list(spec.aliases), attention=spec.attention.value)
    weights = [{"name": w.name, "total_bytes": w.total_bytes,
                "total_gib": round(w.total_bytes / 2**30, 2), "source": w.source}
               for w in spec.weights]
    return {
        **data, "default_weights": spec.weights_format().name, "weights": weights,
        "kv_bytes_per_token": {str(tp): n for tp, n in kv_valid.items()},
        "kv_tp_not_valid": {str(tp): why for tp, why in kv_invalid.items()},
        "notes": spec.notes, "extra": dict(spec.extra),
    }  # fmt: skip


def _params(n: int) -> str:
    return f"{n:,} ({n / 1e9:,.2f}e9)"


def _spec_text(spec: ModelSpec, kv_valid: dict[int, int], kv_invalid: dict[int, str]) -> str:
    attention = spec.attention.value
    if spec.kv_lora_rank is not None:
        attention += (f" (latent cache: kv_lora_rank {spec.kv_lora_rank} + qk_rope_head_dim "
                      f"{spec.qk_rope_head_dim} elements per layer, not split by TP)")
    fields: list[tuple[str, str]] = [
        ("HF id", spec.hf_id),
        ("aliases", ", ".join(spec.aliases) or "none"),
        ("attention", attention),
        ("layers", f"{spec.num_layers:,}"),
        ("hidden size", f"{spec.hidden_size:,} elements"),
        ("attention heads", f"{spec.num_heads:,}"),
        ("KV heads", f"{spec.num_kv_heads:,}"),
        ("head dim", f"{spec.head_dim:,} elements"),
        ("vocab size", f"{spec.vocab_size:,} tokens"),
        ("intermediate size", f"{spec.intermediate_size:,} elements"),
    ]
    if spec.sliding_window is not None:
        fields.append(("sliding window", f"{spec.sliding_window:,} tokens on "
                       f"{spec.sliding_window_layers} of {spec.num_layers} layers"))
    if spec.num_experts:
        fields.append(("experts", f"{spec.num_experts:,} per MoE layer"))
    fields.append(("total params", _params(spec.total_params)))
    if spec.active_params is not None:
        fields.append(("active params", _params(spec.active_params)))
    fields += [
        ("dtype", f"{spec.dtype} ({spec.dtype_bytes} B/element)"),
        ("max position embeddings", f"{spec.max_position_embeddings:,} tokens"),
    ]
    for key, value in sorted(spec.extra.items()):
        fields.append((key.replace("_", " "), value))
    width = max(len(k) for k, _ in fields) + 2
    lines = [spec.name, *(f"  {(k + ':').ljust(width)}{v}" for k, v in fields)]
    lines.append(f"  weights (checkpoint formats; default {spec.weights_format().name}):")
    weight_rows = [(w.name, f"{w.total_bytes:,}", f"{w.total_bytes / GIB:,.2f} GiB", w.source)
                   for w in spec.weights]
    weight_table = table(("FORMAT", "BYTES", "SIZE", "SOURCE"), weight_rows)
    lines += ["    " + line for line in weight_table.splitlines()]
    lines.append(f"  KV cache per token per card (kv dtype {spec.dtype}):")
    kv_rows = [(f"TP {tp}", f"{kv_valid[tp]:,} B" if tp in kv_valid else
                f"not valid: {kv_invalid[tp]}") for tp in SHOW_TPS]
    lines += ["    " + line for line in table(("TP", "BYTES/TOKEN"), kv_rows).splitlines()]
    if spec.notes:
        lines.append(f"  notes: {spec.notes}")
    return "\n".join(lines)
