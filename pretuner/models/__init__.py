"""Model specs: the built-in registry and local Hugging Face folders."""

from pretuner.models.registry import (
    FolderIdentity,
    builtin_specs,
    folder_identity,
    local_model_path,
    lookup,
    resolve,
)
from pretuner.models.spec import AttentionKind, ModelSpec, WeightsFormat

__all__ = ["AttentionKind", "FolderIdentity", "ModelSpec", "WeightsFormat", "builtin_specs",
           "folder_identity", "local_model_path", "lookup", "resolve"]
