"""A local checkpoint's size without loading any weights: the index's total, or the safetensors
*headers* (an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets}}`, then the tensor data, which is never touched); and the
strict reading of the JSON beside it (config keys, registry records) that hf and vision share.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretuner.errors import BadInputError
from pretuner.files import MAX_INPUT_BYTES, read_bounded

# The safetensors format itself refuses headers above 100 MB; a bigger claim means garbage.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# A config's sizes as the engines store them (int32); 10^12 heads is a broken file, and would
# send the arithmetic through billions of steps.
MAX_CONFIG_INT = 2**31 - 1
# No integer in a config comes near this many digits; 400 of them once ended in a traceback.
MAX_JSON_DIGITS = 30

_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Tensors that quantized checkpoints store beside the weights (scales, zero points, offsets):
# they take bytes but are not model parameters.
_AUX_SUFFIXES = (
    "_scale_inv", "_scale", "_scales", ".scales", "_offset", ".qzeros", ".g_idx",
    ".deq_scale", ".quant_bias", "_zero_point",
)

# Bytes per parameter by checkpoint format, to turn an index total into a parameter count
# when the shard headers are not at hand (REFERENCE section 6).
BYTES_PER_PARAM: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0002, "w8a8": 1.0, "w8a16": 1.0,
    "int8": 1.0, "mxfp4": 0.53, "awq": 0.52, "gptq": 0.52,
}

def broken(message: str) -> BadInputError:
    """A broken file's error: whatever broke, the fix is to fetch that file again."""
    return BadInputError(
        message, hint="re-download that file (the download may be incomplete) or remove it")


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """What one safetensors header says: tensor bytes and parameter count."""

    path: Path
    header_bytes: int
    tensor_bytes: int
    params: int


@dataclass(frozen=True, slots=True)
class CheckpointSize:
    """A folder's weights: total bytes, parameter count, and how both were found."""

    total_bytes: int
    params: int
    how: str


def named_hub_id(config: dict[str, Any]) -> str | None:
    """The hub model a folder's config.json says it was saved from (`_name_or_path`), if any."""
    named = config.get("_name_or_path")
    ok = isinstance(named, str) and named.count("/") == 1 and not os.path.isabs(named)
    return named if ok else None


def load_json(path: Path, limit: int = MAX_INPUT_BYTES) -> dict[str, Any]:
    """A JSON object from `path`, read bounded, its numbers finite and of a sane length, its
    nesting within Python's recursion limit."""
    try:
        data = json.loads(read_bounded(path, limit).decode("utf-8"), parse_int=_json_int,
                          parse_float=_json_float, parse_constant=_json_float)
    except UnicodeDecodeError:
        raise broken(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise broken(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: "
                     f"{err.msg})") from None
    except ValueError as err:  # from _json_int or _json_float
        raise broken(f"{path}: {err}") from None
    except RecursionError:
        raise broken(f"{path} nests too deeply to be a model's JSON") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_DIGITS:
        raise ValueError(f"a number of {len(text.lstrip('-'))} digits is beyond any config")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is not finite")
    return value


def reject_unknown(data: dict[str, Any], valid: set[str], what: str) -> None:
    """Refuse the keys a record does not have: a typo must not pass silently."""
    if unknown := set(data) - valid:
        raise BadInputError(f"{what} {', '.join(sorted(unknown))}",
                            hint=f"valid keys: {', '.join(sorted(valid))}")


def config_int(cfg: dict[str, Any], origin: object, *keys: str) -> int | None:
    """The first of `keys` a config sets, checked to be a non-negative integer; None if none."""
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if not _is_count(value):
            raise BadInputError(f"{origin}: {key} must be a non-negative integer, got {value!r}")
        if value > MAX_CONFIG_INT:
            raise BadInputError(f"{origin}: {key} {value:,} is beyond any model "
                                f"(at most {MAX_CONFIG_INT:,})", hint="fix the file")
        return int(value)
    return None


def _tensor_params(name: str, entry: dict[str, Any], quant_bits: int) -> int:
    """Parameters a stored tensor holds: packed low-bit tensors hold several per element."""
    if name.endswith(_AUX_SUFFIXES):
        return 0
    elements = int(math.prod(entry["shape"]))
    dtype = str(entry["dtype"])
    if name.endswith("_blocks") and dtype == "U8":
        return elements * 2  # MXFP4: two 4-bit values per byte
    if name.endswith(".qweight") and dtype in ("I32", "U32"):
        return elements * (32 // quant_bits)  # GPTQ/AWQ pack 32 // bits values per int32
    return elements


def read_safetensors_header(path: Path, *, quant_bits: int = 4) -> SafetensorsHeader:
    """Parse one file's header and check it against the file size; never reads tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise broken(f"{path} is {size} bytes, too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len == 0 or header_len > min(MAX_HEADER_BYTES, size - 8):
                raise broken(f"{path}: safetensors header claims {header_len:,} bytes but the "
                             f"file is {size:,} bytes; the file is truncated or not safetensors")
            raw = f.read(header_len)
    except OSError as err:
        raise BadInputError(f"cannot read {path}: {err.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise broken(f"{path}: safetensors header is not valid JSON; the file is corrupt") from None
    if not isinstance(header, dict):
        raise broken(f"{path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - header_len
    tensor_bytes = 0
    params = 0
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not _valid_entry(entry):
            raise broken(f"{path}: malformed safetensors entry for tensor {name!r}")
        start, end = entry["data_offsets"]
        tensor_bytes += end - start
        data_end = max(data_end, end)
        params += _tensor_params(name, entry, quant_bits)
    if data_end > data_bytes:
        raise broken(f"{path} is {size:,} bytes but its header places tensor data up to byte "
                     f"{8 + header_len + data_end:,}; the download is incomplete")
    return SafetensorsHeader(path, header_len, tensor_bytes, params)


def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2:
        return False
    start, end = offsets
    return _is_count(start) and _is_count(end) and start <= end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def checkpoint_size(folder: Path, fmt: str, quant_bits: int = 4) -> CheckpointSize | None:
    """Bytes and parameters of the folder's weights, or None when it holds no checkpoint."""
    # The index's total_size gives the bytes when present; the shard headers the parameter
    # count when every shard is present (else bytes / bytes-per-param).
    index_total: int | None = None
    shard_names: list[str] = []
    index_path = next((folder / n for n in _INDEX_FILES if (folder / n).is_file()), None)
    if index_path is not None:
        index = load_json(index_path, MAX_HEADER_BYTES)  # a large model's map of tensors
        metadata = index.get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        if not _is_count(total) or total == 0:
            raise broken(f"{index_path} has no positive integer metadata.total_size")
        index_total = total
        weight_map = index.get("weight_map")
        if isinstance(weight_map, dict):
            shard_names = sorted({v for v in weight_map.values() if isinstance(v, str)})

    if shard_names:
        shards = [folder / name for name in shard_names if name.endswith(".safetensors")]
        if len(shards) != len(shard_names) or not all(p.is_file() for p in shards):
            shards = []  # shards missing or not safetensors: size from the index alone
    else:
        shards = sorted(folder.glob("*.safetensors"))

    headers = [read_safetensors_header(p, quant_bits=quant_bits) for p in shards]
    if index_total is not None:
        if headers:
            params = sum(h.params for h in headers)
            how = f"index total_size, parameters from {len(headers)} safetensors header(s)"
        else:
            params = round(index_total / BYTES_PER_PARAM.get(fmt, 2.0))
            how = "index total_size, parameters estimated from bytes per parameter"
        return CheckpointSize(index_total, params, how)
    if headers:
        return CheckpointSize(
            sum(h.tensor_bytes for h in headers),
            sum(h.params for h in headers),
            f"{len(headers)} safetensors header(s)",
        )
    return None
