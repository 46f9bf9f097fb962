"""Paths on a node's own disk (pure).

A node of a real cluster has its own disk, and a rank writes its logs there. The emulated
cluster of the tests runs every node on one machine, so each node stands its own disk in with
a folder: `PRETUNER_SIM_NODE_ROOT`, exported before that node's `ray start` like any node
variable. The emulated ranks write under it and pretuner's log task reads under it; a real
node never sets it and every path is itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

NODE_ROOT_ENV = "PRETUNER_SIM_NODE_ROOT"


def node_local(path: Path | str, env: Mapping[str, str] | None = None) -> Path:
    """`path` as it lies on this node's disk."""
    env = os.environ if env is None else env
    root = env.get(NODE_ROOT_ENV)
    path = Path(path)
    if not root:
        return path
    return Path(root) / path.relative_to(path.anchor)
