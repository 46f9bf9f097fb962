"""Tuned configurations with their provenance: one JSON file per preset under `data/`."""

from pretuner.presets.model import (
    KvBasis,
    Preset,
    PresetKind,
    all_presets,
    builtin_presets,
    check_preset,
    find_preset,
    get_preset,
    load_preset_file,
    preset_from_report,
    preset_to_json,
    resolve_preset,
    user_presets_dir,
)

__all__ = [
    "KvBasis",
    "Preset",
    "PresetKind",
    "all_presets",
    "builtin_presets",
    "check_preset",
    "find_preset",
    "get_preset",
    "load_preset_file",
    "preset_from_report",
    "preset_to_json",
    "resolve_preset",
    "user_presets_dir",
]
