"""Model specs: the built-in registry and local Hugging Face folders."""

from pretuner.models.registry import builtin_specs, lookup, resolve
from pretuner.models.spec import AttentionKind, ModelSpec, WeightsFormat

__all__ = ["AttentionKind", "ModelSpec", "WeightsFormat", "builtin_specs", "lookup", "resolve"]
