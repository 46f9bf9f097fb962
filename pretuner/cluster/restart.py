"""The `ray stop` / `ray start` commands that give every node its environment (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pretuner.cluster.env import NodeProbe
from pretuner.templating import render_template


def restart_commands(
    probes: Sequence[NodeProbe],
    envs: Mapping[str, Mapping[str, str]],
    *,
    head_host: str,
    port: int,
    extra_args: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """Shell lines for every node, the head first: `ray stop`, the exports, `ray start`.

    `envs` maps a node id to what it must export (`env.proposed_envs`); `extra_args` adds
    `ray start` arguments per node id (the emulated card's NPUs, which Ray cannot detect).
    """
    ordered = sorted(probes, key=lambda p: (not p.node.head, p.node.address, p.node.node_id))
    nodes = [
        {
            "label": p.node.label,
            "head": p.node.head,
            "env": dict(envs.get(p.node.node_id, {})),
            "extra": list((extra_args or {}).get(p.node.node_id, ())),
        }
        for p in ordered
    ]
    return render_template(
        "ray-restart.sh.j2", {"nodes": nodes, "head_address": head_host, "port": port}
    )
