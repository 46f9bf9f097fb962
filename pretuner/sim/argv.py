"""The emulated servers' command-line spelling rule, shared by the r0.1 and V1 servers."""

from __future__ import annotations

from collections.abc import Sequence


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser: `--max_model_len` is `--max-model-len`."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out
