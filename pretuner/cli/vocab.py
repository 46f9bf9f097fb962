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


def tokens_option(flag: str, text: str) -> Any:
    """An optional token count, written as vLLM reads one (`human_int`); `text` is its help."""
    return typer.Option(None, flag, metavar="TOKENS", parser=human_int, help=text)


def kv_dtype(value: KvDtype | str) -> str:
    """pretuner's name for a KV dtype given in vLLM's or pretuner's spelling."""
    text = value.value if isinstance(value, KvDtype) else value
    return KV_DTYPE_ALIASES.get(text, text)


# `vllm serve --config` keys -> `pretuner run` parameters: vLLM's name with underscores, but for
# the three pretuner spells shorter.
CONFIG_KEYS = {
    "gpu-memory-utilization": "util", "tensor-parallel-size": "tp", "pipeline-parallel-size": "pp",
    **{key: key.replace("-", "_") for key in (
        "model", "max-model-len", "max-num-seqs", "max-num-batched-tokens", "block-size",
        "kv-cache-dtype", "limit-mm-per-prompt", "mm-processor-cache-gb", "quantization",
        "cpu-offload-gb", "swap-space", "enforce-eager")},
}
# Keys pretuner decides for every launch: a config that sets them would be overruled.
OWNED_KEYS = {"kv-cache-memory-bytes": "it is what pretuner measures; drop it from the config"}
CONFIG_EXTRA = "pretuner_config_extra"


def read_vllm_config(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The `pretuner run` defaults a vLLM config file gives, and its other keys as server flags
    (one `--server-arg` each, quoted: a value is never split at its spaces).

    Keys may be spelled with `-` or `_`, as vLLM allows; a value that is a list becomes one
    flag per item, `true` a bare flag and `false` its `--no-` form.
    """
    import yaml  # here, not at the top: `pretuner --help` never reads a config

    try:
        data = yaml.safe_load(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise typer.BadParameter(f"cannot read {str(path)!r}: {err}") from None
    except yaml.YAMLError as err:
        raise typer.BadParameter(f"{str(path)!r} is not YAML: {err}") from None
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
            defaults[CONFIG_KEYS[key]] = json.dumps(value) if isinstance(value, dict) else value
        elif flags := _flags(key, value):
            extra.append(shlex.join(flags))
    return defaults, extra


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
