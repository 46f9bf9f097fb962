"""The checks behind `RunOptions.check()` and `RunOptions.from_json()`: one place for the rules
every way into `pretuner run` meets (flags, a library call, a journal read back by --resume)."""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from pretuner import validate as v
from pretuner.errors import BadInputError
from pretuner.kvmath import KV_DTYPES

if TYPE_CHECKING:
    from pretuner.tune.entry import RunOptions

T = TypeVar("T")


def check_run_options(o: RunOptions) -> None:
    """Refuse a bad value of `o` with a one-line error naming it (exit 2)."""
    if not o.model.strip():
        raise BadInputError("--model is empty", hint="pass a registry name or a model folder")
    if o.card_gib is not None and o.card_gib < 1:
        raise BadInputError(
            f"card size {o.card_gib} GiB is invalid", hint="pass the card's GiB, e.g. --card 64"
        )
    if o.card_gib is not None:
        v.int_range("--card", o.card_gib, 1, v.MAX_CARD_GIB)
    v.finite("--util", o.util, example="0.9")
    if not 0 < o.util <= 1:
        raise BadInputError(
            f"--util {o.util} is outside (0, 1]", hint="use the fraction of the card, e.g. 0.9"
        )
    for flag, value in (("--max-model-len", o.max_model_len), ("--min-model-len", o.min_model_len)):
        if value is not None:
            v.int_range(flag, value, 1)
    if o.tp is not None:
        v.int_range("--tp", o.tp, 1)
    v.int_range("--pp", o.pp, 1)
    if o.nodes is not None:
        v.int_range("--nodes", o.nodes, 1)
    v.choice("--block-size", o.block_size, v.BLOCK_SIZES)
    v.choice("--kv-cache-dtype", o.kv_cache_dtype, KV_DTYPES)
    if o.headroom_gib is not None:
        v.non_negative("--headroom-gb", o.headroom_gib, example="1")
    if o.reserve_gib is not None:
        v.non_negative("--reserve-gb", o.reserve_gib, example="1")
    if o.model_use_gib is not None:
        v.int_range("--model-use-gb", o.model_use_gib, 1)
    v.int_range("--max-launches", o.max_launches, 1)
    if o.max_launches < 2 and o.validate:
        raise BadInputError(
            f"--max-launches {o.max_launches} leaves no launch for validation",
            hint="use 2 or more, or --no-validate",
        )
    if o.serve_cmd is not None:
        v.command_line("--serve-cmd", o.serve_cmd)
    if o.out is not None:
        v.path_text("--out", o.out)
    v.path_text("runs folder", o.runs_dir)
    v.positive("--ready-timeout", o.ready_timeout_s, example="1800")
    v.positive("--request-timeout", o.request_timeout_s, example="900")
    v.non_negative("--stop-grace", o.stop_grace_s, example="120")
    if not o.host.strip():
        raise BadInputError("the server host is empty", hint="use 127.0.0.1")


def options_from_json(cls: type[T], data: Any, made_by: str | None) -> T:
    """`cls(**data)` for a journal's recorded options, every key and type checked first."""
    who = f"pretuner {made_by}" if made_by else "another pretuner version (none recorded)"
    if not isinstance(data, dict):
        raise BadInputError(
            f"the journal's run options are a {type(data).__name__}, not an object",
            hint="the journal is damaged: start a new run",
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise BadInputError(
            f"the journal records run option {unknown[0]!r}, unknown to this pretuner; "
            f"the run was made by {who}",
            hint="resume it with that version, or start a new run",
        )
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in data
    )
    if missing:
        raise BadInputError(
            f"the journal's run options lack {missing[0]!r}; the run was made by {who}",
            hint="resume it with that version, or start a new run",
        )
    for key, value in data.items():
        if not v.fits_type(value, hints[key]):
            want = getattr(hints[key], "__name__", str(hints[key]))
            raise BadInputError(
                f"the journal records run option {key} = {value!r}, not {want}",
                hint=f"the run was made by {who} or edited: start a new run",
            )
    return cls(**data)
