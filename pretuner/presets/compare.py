"""One line for `run` and `plan`: is there a preset for this model, card and layout?"""

from __future__ import annotations

from pretuner.presets.model import find_preset


def preset_line(model: str, card_gib: int, tp: int, kv_tokens: int, what: str) -> str:
    p = find_preset(model, card_gib, tp)
    if p is None:
        return f"preset: none for {model} on {card_gib} GiB cards at TP{tp}"
    diff = kv_tokens - p.kv_tokens
    pct = f" ({diff / p.kv_tokens:+.1%})" if p.kv_tokens else ""
    return (
        f"preset {p.name} ({p.kind.value}): {p.kv_tokens:,} KV tokens/card; this {what} result "
        f"{kv_tokens:,} differs by {diff:+,}{pct}"
    )
