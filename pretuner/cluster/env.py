"""Which environment every node needs before `ray start` and the commands that restart Ray with
it, and what a launch passes itself (pure).

Two kinds of variables reach a rank on another node:

- **Node variables** (REFERENCE section 7: the NIC, HCCL, LCCL, VMM and visible-device settings,
  the MindFormers backend): a Ray worker inherits them from the raylet, that is from the shell
  that ran `ray start`. `ASCEND_RT_VISIBLE_DEVICES` also decides how many NPUs Ray counts on
  the node. pretuner does not override them per launch: production serves with what
  `ray start` exported, and the tuned figures must come from the same setup. When a node lacks
  one, pretuner refuses and prints the `ray stop` / `ray start` commands that fix it.
- **Launch variables** (`GLOG_v`, `GLOG_logtostderr`, `GLOG_log_dir`, `ASCEND_TOTAL_MEMORY_GB`,
  `vLLM_MODEL_MEMORY_USE_GB`: everything pretuner sets for one launch): they change between
  the pre-run and the validation, so pretuner hands them to every rank through the launch's
  Ray job runtime env (`RAY_JOB_CONFIG_JSON_ENV_VAR`, the variable `ray job submit` uses to
  give its entrypoint a runtime env), which Ray applies to every task and actor of the job,
  vLLM's workers included, on top of the raylet's environment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pretuner.cluster.nodefs import NODE_ROOT_ENV
from pretuner.cluster.nodes import NodeFacts, Placement
from pretuner.templating import render_template


@dataclass(frozen=True, slots=True)
class NodeVar:
    """A variable every node must export before `ray start`."""

    name: str
    why: str
    required: bool = True
    same_on_every_node: bool = True
    interface: bool = False  # names a network interface of the node (differs per node)
    devices: bool = False  # a device list: at least as many as the node's ranks
    value: str | None = None  # the vLLM-MindSpore multi-node guide's value


NODE_VARS: tuple[NodeVar, ...] = (
    NodeVar("GLOO_SOCKET_IFNAME", "NIC of gloo", same_on_every_node=False, interface=True),
    NodeVar("HCCL_SOCKET_IFNAME", "NIC of HCCL", same_on_every_node=False, interface=True),
    NodeVar("TP_SOCKET_IFNAME", "NIC of TP traffic", same_on_every_node=False, interface=True),
    NodeVar("MS_ENABLE_LCCL", "LCCL off across nodes", value="off"),
    NodeVar("HCCL_OP_EXPANSION_MODE", "HCCL kernel expansion", value="AIV"),
    NodeVar("MS_ALLOC_CONF", "virtual memory in MindSpore's pool", value="enable_vmm:true"),
    NodeVar("ASCEND_RT_VISIBLE_DEVICES", "the cards of the node (Ray counts its NPUs from it)",
            same_on_every_node=False, devices=True),
    NodeVar("vLLM_MODEL_BACKEND", "model backend (r0.1-0.3)", required=False),
    NodeVar("MINDFORMERS_MODEL_CONFIG", "MindFormers model YAML", required=False),
)
# What the probe reads on each node: the node variables, and the emulator's stand-in for a
# node's own disk (kept in the printed commands so that they rebuild the same node).
PROBED_VARS: tuple[str, ...] = (*(v.name for v in NODE_VARS), NODE_ROOT_ENV)
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def node_exports(nic: str, cards: int) -> dict[str, str]:
    """The required node variables with the guide's values (`ray-head.sh`, `ray-worker.sh`)."""
    out = {}
    for var in NODE_VARS:
        if not var.required:
            continue
        if var.interface:
            out[var.name] = nic
        elif var.devices:
            out[var.name] = ",".join(str(i) for i in range(cards))
        elif var.value is not None:
            out[var.name] = var.value
    return out


def job_config_env(launch_env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment entry that gives every rank of the launch `launch_env`."""
    return {JOB_CONFIG_ENV: json.dumps({"runtime_env": {"env_vars": dict(launch_env)}})}


@dataclass(frozen=True, slots=True)
class NodeProbe:
    """What a task pinned to one node found there."""

    node: NodeFacts
    version: str | None  # pretuner's version as the node's Ray workers import it
    env: dict[str, str]  # PROBED_VARS present in the node's Ray worker environment
    interfaces: tuple[str, ...]
    address_nic: str | None = None  # the interface holding the node's Ray address


@dataclass(frozen=True, slots=True)
class EnvProblem:
    node: NodeFacts
    name: str
    what: str  # "is missing", or "=VALUE" and what is wrong with it


def describe_problems(problems: Sequence[EnvProblem]) -> str:
    """`10.0.0.1 (33c30b62) lacks A, B; 10.0.0.2 (6ae8ef24) C=eth9 names no network ...`."""
    by_node: dict[str, tuple[list[str], list[str]]] = {}
    for e in problems:
        missing, other = by_node.setdefault(e.node.label, ([], []))
        if e.what == "is missing":
            missing.append(e.name)
        else:
            other.append(f"{e.name}{e.what}")
    parts = []
    for label, (missing, other) in by_node.items():
        said = ([f"lacks {', '.join(missing)}"] if missing else []) + other
        parts.append(f"{label} {'; '.join(said)}")
    return "; ".join(parts)


def _device_count(raw: str) -> int | None:
    try:
        return len([int(x) for x in raw.split(",") if x.strip()])
    except ValueError:
        return None


def env_problems(probes: Sequence[NodeProbe], placement: Placement) -> list[EnvProblem]:
    """Every node variable that is missing, wrong for its node, or differs between nodes."""
    ranks = {n.node_id: c for n, c in zip(placement.nodes, placement.ranks_per_node, strict=True)}
    problems: list[EnvProblem] = []
    for var in NODE_VARS:
        values = {p.node.node_id: p.env.get(var.name) for p in probes}
        for p in probes:
            value = values[p.node.node_id]
            if value is None:
                if var.required:
                    problems.append(EnvProblem(p.node, var.name, "is missing"))
                continue
            if var.interface and value not in p.interfaces:
                problems.append(EnvProblem(p.node, var.name,
                                           f"={value} names no network interface of it"))
            count, need = _device_count(value), ranks.get(p.node.node_id, 0)
            if var.devices and (count is None or count < need):
                problems.append(EnvProblem(p.node, var.name,
                                           f"={value} lists fewer than its {need} ranks"))
        present = {v for v in values.values() if v is not None}
        if var.same_on_every_node and len(present) > 1:
            for p in probes:
                value = values[p.node.node_id]
                if value is not None:
                    problems.append(EnvProblem(p.node, var.name,
                                               f"={value} differs from another node's"))
    return problems


def proposed_envs(probes: Sequence[NodeProbe], placement: Placement) -> dict[str, dict[str, str]]:
    """Node id -> the node variables it should export before `ray start` (its own where right)."""
    bad = {(e.node.node_id, e.name) for e in env_problems(probes, placement)}
    ranks = {n.node_id: c for n, c in zip(placement.nodes, placement.ranks_per_node, strict=True)}
    # Values that must agree: the guide's value if a node has it, else the local node's, else
    # the first node's.
    agreed = {}
    ordered = sorted(probes, key=lambda p: not p.node.local)
    for var in NODE_VARS:
        values = [p.env[var.name] for p in ordered if var.name in p.env]
        if var.same_on_every_node and values:
            agreed[var.name] = var.value if var.value in values else values[0]
    out: dict[str, dict[str, str]] = {}
    for p in probes:
        env: dict[str, str] = {}
        others = [i for i in p.interfaces if i != "lo"]
        guide = node_exports(p.address_nic or (others[0] if others else "lo"),
                             max(p.node.npus, ranks.get(p.node.node_id, 0)))
        for var in NODE_VARS:
            own = p.env.get(var.name)
            if var.same_on_every_node and var.name in agreed:
                env[var.name] = agreed[var.name]
            elif own is not None and (p.node.node_id, var.name) not in bad:
                env[var.name] = own
            elif var.name in guide:
                env[var.name] = guide[var.name]
        root = p.env.get(NODE_ROOT_ENV)
        if root:
            env[NODE_ROOT_ENV] = root
        out[p.node.node_id] = env
    return out


def restart_commands(probes: Sequence[NodeProbe], envs: Mapping[str, Mapping[str, str]], *,
                     head_host: str, port: int,
                     extra_args: Mapping[str, Sequence[str]] | None = None) -> str:
    """Shell lines for every node, the head first: `ray stop`, the exports (`proposed_envs`),
    `ray start` with `extra_args` per node id (the emulated card's NPUs Ray cannot detect)."""
    ordered = sorted(probes, key=lambda p: (not p.node.head, p.node.address, p.node.node_id))
    nodes = [{"label": p.node.label, "head": p.node.head, "env": dict(envs.get(p.node.node_id, {})),
              "extra": list((extra_args or {}).get(p.node.node_id, ()))} for p in ordered]
    return render_template("ray-restart.sh.j2",
                           {"nodes": nodes, "head_address": head_host, "port": port})
