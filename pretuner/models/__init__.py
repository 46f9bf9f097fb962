"""Model specs: the built-in registry and local Hugging Face folders."""

from pretuner.models.registry import builtin_specs, local_model_path, lookup, resolve
from pretuner.models.spec import AttentionKind, ModelSpec, WeightsFormat

__all__ = ["AttentionKind", "ModelSpec", "WeightsFormat", "builtin_specs", "local_model_path",
           "lookup", "resolve"]
