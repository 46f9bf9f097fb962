"""The built-in model registry: one JSON file per model under `pretuner/models/data/`."""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pretuner.errors import BadInputError, UnknownModelError
from pretuner.models.checkpoint import named_hub_id, reject_unknown
from pretuner.models.spec import AttentionKind, ModelSpec, WeightsFormat
from pretuner.models.vision import vision_from_dict

# A registry file spells every field but the quantization (a local folder's config.json has it).
_SPEC_KEYS = {f.name for f in fields(ModelSpec)} - {"quantization"}
_WEIGHTS_KEYS = {f.name for f in fields(WeightsFormat)}


def spec_from_dict(data: dict[str, Any], origin: str) -> ModelSpec:
    """Build a spec from its JSON form, rejecting unknown keys."""
    reject_unknown(data, _SPEC_KEYS, f"{origin}: unknown key(s)")
    weights = []
    for w in data.get("weights", []):
        reject_unknown(w, _WEIGHTS_KEYS, f"{origin}: unknown weights key(s)")
        weights.append(WeightsFormat(**w))
    values = {**data, "weights": tuple(weights), "aliases": tuple(data.get("aliases", ())),
              "attention": AttentionKind(data["attention"])}
    if data.get("vision") is not None:
        values["vision"] = vision_from_dict(data["vision"], origin)
    try:
        return ModelSpec(**values)
    except TypeError as err:
        raise BadInputError(f"{origin}: {err}") from None


@cache
def builtin_specs() -> tuple[ModelSpec, ...]:
    """Every spec shipped with the package, sorted by name."""
    data = resources.files("pretuner.models").joinpath("data")
    specs = [spec_from_dict(json.loads(e.read_text("utf-8")), e.name) for e in data.iterdir()
             if e.name.endswith(".json")]
    return tuple(sorted(specs, key=lambda s: s.name))


def _norm(name: str) -> str:
    return name.strip().lower()


@cache
def _alias_table() -> dict[str, ModelSpec]:
    table: dict[str, ModelSpec] = {}
    for spec in builtin_specs():
        for key in (spec.name, spec.hf_id, spec.hf_id.split("/")[-1], *spec.aliases):
            table[_norm(key)] = spec
    return table


def lookup(name: str) -> ModelSpec:
    """A built-in spec by name, alias or Hugging Face id, case-insensitive."""
    table = _alias_table()
    spec = table.get(_norm(name))
    if spec is not None:
        return spec
    names = sorted({s.name for s in builtin_specs()})
    close = difflib.get_close_matches(_norm(name), names, n=3, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(_norm(name), list(table), n=3, cutoff=0.6)
        close = sorted({table[c].name for c in close})
    raise UnknownModelError(name, close)


def local_model_path(name_or_path: str) -> str | None:
    """A model folder as an absolute path, None for a registry name: serve.sh, the systemd unit
    and the re-tune command run from other folders than the run did."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.is_dir() else None


@dataclass(frozen=True, slots=True)
class FolderIdentity:
    """Which local model a run served: a folder is known by its absolute path and its
    config.json, never by its base name (a fine-tune in `qwen3-8b/` is not Qwen/Qwen3-8B)."""

    path: str
    config_sha256: str  # of config.json's bytes
    hub_id: str | None  # what config.json's `_name_or_path` names; None: nothing


def folder_identity(name_or_path: str) -> FolderIdentity | None:
    """A local model folder's identity; None for a registry name (or a folder now gone)."""
    local = local_model_path(name_or_path)
    if local is None:
        return None
    try:
        raw = (Path(local) / "config.json").read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None  # spec_from_folder read it when the run started: it says what is wrong
    hub = named_hub_id(config) if isinstance(config, dict) else None
    return FolderIdentity(local, hashlib.sha256(raw).hexdigest(), hub)


def resolve(name_or_path: str) -> ModelSpec:
    """A registry name, or a local Hugging Face model folder (config.json + safetensors)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        from pretuner.models.hf import spec_from_folder

        return spec_from_folder(path)
    return lookup(name_or_path)
