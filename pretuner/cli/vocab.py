"""vLLM's own spelling on pretuner's command line: its flag names, `32K`-style integers, its KV
dtype names, and `--config x.yaml` with `vllm serve --config`'s long-form keys.

A vLLM user pastes what they already run; pretuner keeps its short names beside them.
"""

from __future__ import annotations

import json
import re
import shlex
from enum import Enum
from pathlib import Path
from typing import Any

import typer

UTIL_FLAGS = ("--util", "--gpu-memory-utilization")
TP_FLAGS = ("--tp", "--tensor-parallel-size", "-tp")
PP_FLAGS = ("--pp", "--pipeline-parallel-size", "-pp")

# vLLM's names for the KV dtypes pretuner spells shorter.
KV_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16"}


class KvDtype(str, Enum):
    """`--kv-cache-dtype` as typed: pretuner's names and vLLM's (help lists them)."""

    AUTO = "auto"
    BF16 = "bf16"
    BFLOAT16 = "bfloat16"
    FP16 = "fp16"
    FLOAT16 = "float16"
    INT8 = "int8"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8_MLA = "int8-mla"

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")


def human_int(value: str | int) -> int:
    """An integer as vLLM reads one: `32768`, `32K` (x 1024), `32k` or `25.6k` (x 1000)."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    match = _HUMAN.fullmatch(text)
    if match is None:
        raise typer.BadParameter(
            f"{text!r} is not a whole number; write it like 32768, 32K (x1024) or 32k (x1000)"
        )
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise typer.BadParameter(
                f"{text!r}: a binary suffix takes a whole number; write {number}{suffix.lower()} "
                f"(x1000) or a whole {suffix} count"
            )
        return int(number) * _BINARY[suffix]
    scaled = float(number) * _DECIMAL.get(suffix, 1)
    if scaled != int(scaled):
        raise typer.BadParameter(f"{text!r} is not a whole number of tokens")
    return int(scaled)


_DECIMAL_NUMBER = r"\d+(?:\.\d+)?"
_DURATION = re.compile(rf"(?:({_DECIMAL_NUMBER})h)?(?:({_DECIMAL_NUMBER})m)?", re.IGNORECASE)


def human_minutes(value: str | float) -> float:
    """A duration in minutes: `90` (minutes), `90m`, `1.5h`, `2h30m`."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    if (plain := re.fullmatch(_DECIMAL_NUMBER, text)) is not None:
        return float(plain.group())
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise typer.BadParameter(
            f"{text!r} is not a duration; write it like 90 (minutes), 90m, 1.5h or 2h30m")
    hours, minutes = match.groups()
    return float(hours or 0) * 60 + float(minutes or 0)


def kv_dtype(value: KvDtype | str) -> str:
    """pretuner's name for a KV dtype given in vLLM's or pretuner's spelling."""
    text = value.value if isinstance(value, KvDtype) else value
    return KV_DTYPE_ALIASES.get(text, text)


# `vllm serve --config` keys -> `pretuner run` parameters: vLLM's name with underscores, but for
# the three pretuner spells shorter and the two whose unit it names.
CONFIG_KEYS = {
    "gpu-memory-utilization": "util", "tensor-parallel-size": "tp", "pipeline-parallel-size": "pp",
    "cpu-offload-gb": "cpu_offload_gib", "swap-space": "swap_space_gib",
    **{key: key.replace("-", "_") for key in (
        "model", "max-model-len", "max-num-seqs", "max-num-batched-tokens", "block-size",
        "kv-cache-dtype", "limit-mm-per-prompt", "mm-processor-cache-gb", "quantization",
        "enforce-eager")},
}
# The YAML types each of those takes (vLLM's own argument types); a count is never `true`.
_COUNT, _NUMBER, _TOKENS, _TEXT = (int,), (int, float), (int, str), (str,)
CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "util": _NUMBER, "tp": _COUNT, "pp": _COUNT, "model": _TEXT, "max_model_len": _TOKENS,
    "max_num_seqs": _COUNT, "max_num_batched_tokens": _TOKENS, "block_size": _COUNT,
    "kv_cache_dtype": _TEXT, "limit_mm_per_prompt": (dict, str), "mm_processor_cache_gb": _NUMBER,
    "quantization": _TEXT, "cpu_offload_gib": _NUMBER, "swap_space_gib": _NUMBER,
    "enforce_eager": (bool,),
}
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               dict: "a mapping"}
# Keys pretuner decides for every launch: a config that sets them would be overruled.
OWNED_KEYS = {"kv-cache-memory-bytes": "it is what pretuner measures; drop it from the config"}
CONFIG_EXTRA = "pretuner_config_extra"


def read_vllm_config(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The `pretuner run` defaults a vLLM config file gives, typed, and its other keys as
    server flags (one `--server-arg` each, quoted: a value is never split at its spaces).

    Keys may be spelled with `-` or `_`, as vLLM allows; a value that is a list becomes one
    flag per item, `true` a bare flag and `false` its `--no-` form. The file is read bounded
    (`read_bounded`, `check_expanded`): a device, a FIFO or an alias bomb is refused.
    """
    import yaml  # here, not at the top: `pretuner --help` never reads a config

    from pretuner.errors import BadInputError
    from pretuner.files import check_expanded, read_bounded

    try:
        # libyaml's loader where PyYAML has it: it refuses deep nesting at once (the pure
        # Python one takes seconds to hit the recursion limit)
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(read_bounded(path), Loader=loader)  # noqa: S506 (a safe loader)
        check_expanded(data, path)
    except BadInputError as err:
        raise typer.BadParameter(str(err)) from None
    except RecursionError:
        raise typer.BadParameter(f"{str(path)!r} nests too deeply to be a vLLM config") from None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())  # one line: PyYAML's is several
        raise typer.BadParameter(f"{str(path)!r} is not YAML: {reason}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise typer.BadParameter(
            f"{str(path)!r} holds a {type(data).__name__}, not the mapping of vLLM's long-form "
            "keys (max-model-len: 32768 ...)"
        )
    defaults: dict[str, Any] = {}
    extra: list[str] = []
    for raw_key, value in data.items():
        key = str(raw_key).replace("_", "-")
        if key in OWNED_KEYS:
            raise typer.BadParameter(f"{str(path)!r} sets {key}: {OWNED_KEYS[key]}")
        if key in CONFIG_KEYS:  # a mapping (limit-mm-per-prompt: {image: 2}) as vLLM's JSON
            value = _typed(path, key, value)
            defaults[CONFIG_KEYS[key]] = json.dumps(value) if isinstance(value, dict) else value
        elif flags := _flags(key, value):
            extra.append(shlex.join(flags))
    return defaults, extra


def _typed(path: Path, key: str, value: Any) -> Any:
    """`value` when it has a type `key` takes (`max-model-len: true` does not); null is unset."""
    types = CONFIG_TYPES[CONFIG_KEYS[key]]
    if value is None or isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return value
    want = " or ".join(_TYPE_WORDS[t] for t in types)
    raise typer.BadParameter(f"{str(path)!r}: {key}: {json.dumps(value, default=str)} is not "
                             f"{want}")


def _flags(key: str, value: Any) -> list[str]:
    if value is True:
        return [f"--{key}"]
    if value is False:
        return [f"--no-{key}"]
    if value is None:
        return []
    if isinstance(value, list):
        return [part for item in value for part in _flags(key, item)]
    if isinstance(value, dict):
        return [f"--{key}", json.dumps(value, separators=(",", ":"))]
    return [f"--{key}", str(value)]


def config_callback(
    ctx: typer.Context, param: typer.CallbackParam, value: Path | None
) -> Path | None:
    """`--config`: the file's values become defaults, so a flag on the command line wins."""
    if value is None:
        return None
    defaults, extra = read_vllm_config(value)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[CONFIG_EXTRA] = extra
    return value
