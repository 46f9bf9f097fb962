"""pretuner's Ray driver: connect, list the nodes, and run small tasks pinned to each node.

The only module that imports Ray, and only inside functions. Every task runs with
`num_cpus=0` (it must run even while the server's ranks hold the node) and hard node
affinity, so what it reads is what that node has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from pretuner.cluster.env import PROBED_VARS, NodeProbe
from pretuner.cluster.nodes import NodeFacts
from pretuner.errors import BadInputError, ClusterError

TASK_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 5.0
HEAD_RESOURCE = "node:__internal_head__"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise BadInputError(
            "--ray-address needs Ray, which is not installed here",
            hint="install pretuner's `ray` extra (pip install 'pretuner[ray]') on every node",
        ) from None
    return ray


class RayCluster:
    """A connection to a running Ray cluster, as one more driver (its own Ray job)."""

    def __init__(self, ray: Any, address: str, resource: str = "NPU") -> None:
        self._ray = ray
        self.address = address
        self.resource = resource  # what one rank holds: `NPU` (Ascend) or `GPU` (CUDA)
        self.gcs_address: str = ray.get_runtime_context().gcs_address
        self.local_node_id: str = ray.get_runtime_context().get_node_id()
        self._remote: dict[Callable[..., Any], Any] = {}

    @classmethod
    def connect(cls, address: str, resource: str = "NPU") -> RayCluster:
        check_address(address)
        ray = _ray()
        if ray.is_initialized():
            ray.shutdown()
        try:
            # No runtime env: the probe must see each node's own environment.
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
                     namespace="pretuner")
        except Exception as err:  # Ray raises ConnectionError, RuntimeError...
            raise ClusterError(
                f"cannot connect to the Ray cluster at {address!r}: {_one_line(err)}",
                hint="start Ray first (`ray start --head --port=6379` on the head, `ray start "
                "--address=HEAD_IP:6379` on the others) and run pretuner on one of its nodes",
            ) from None
        return cls(ray, address, resource)

    def close(self) -> None:
        self._ray.shutdown()

    def nodes(self) -> tuple[NodeFacts, ...]:
        """Every node Ray knows, dead ones included."""
        out = []
        for n in self._ray.nodes():
            resources = n.get("Resources") or {}
            node_id = n["NodeID"]
            out.append(NodeFacts(node_id, n.get("NodeManagerAddress", "?"), bool(n.get("Alive")),
                                 int(resources.get(self.resource, 0)),
                                 node_id == self.local_node_id,
                                 HEAD_RESOURCE in resources))
        return tuple(out)

    def free_npus(self) -> int:
        return int(self._ray.available_resources().get(self.resource, 0))

    def submit(self, node: NodeFacts, fn: Callable[..., Any], *args: Any) -> Any:
        """Start `fn(*args)` on `node`; returns the Ray object ref."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = self._remote.get(fn)
        if task is None:
            task = self._remote[fn] = self._ray.remote(num_cpus=0, max_retries=0)(fn)
        strategy = NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)
        return task.options(scheduling_strategy=strategy).remote(*args)

    def gather(self, refs: Sequence[Any], nodes: Sequence[NodeFacts], what: str,
               timeout_s: float) -> list[Any]:
        """The results of tasks started with `submit`; ClusterError names the node that failed."""
        out = []
        for ref, node in zip(refs, nodes, strict=True):
            try:
                out.append(self._ray.get(ref, timeout=timeout_s))
            except self._ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"{what} on node {node.label} did not answer within {timeout_s:.0f} s",
                    hint="check the node with `ray status`; a node without a free CPU slot for "
                    "a worker process, or a dead raylet, blocks it",
                ) from None
            except Exception as err:  # a task error wraps whatever it raised
                raise ClusterError(
                    f"{what} failed on node {node.label}: {_one_line(err)}",
                    hint="check that pretuner (same version, `ray` extra) is installed in the "
                    "Python environment that ran `ray start` on that node",
                ) from None
        return out

    def ready(self, refs: Sequence[Any]) -> bool:
        done, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def largest(self, resource: str) -> int:
        """The most of `resource` (GPU, NPU, CPU) one alive node has."""
        return max((int((n.get("Resources") or {}).get(resource, 0))
                    for n in self._ray.nodes() if n.get("Alive")), default=0)

    def submit_holding(self, fn: Callable[..., Any], resource: str, count: int,
                       *args: Any) -> Any:
        """Start the generator `fn(*args)` on any node with `count` free `resource` (GPU, NPU:
        Ray sets the task's CUDA_ / ASCEND_RT_VISIBLE_DEVICES to the ones it holds; CPU); held
        until it ends. Returns its generator of object refs."""
        want: dict[str, Any] = (
            {"num_cpus": count} if resource == "CPU"
            else {"num_cpus": 0, "num_gpus": count} if resource == "GPU"
            else {"num_cpus": 0, "resources": {resource: count}})
        task = self._ray.remote(max_retries=0, **want)(fn)
        return task.remote(*args)

    def wait_any(self, gens: Sequence[Any], timeout_s: float = 1.0) -> list[Any]:
        """The task generators among `gens` with their next item (or their end) ready."""
        done, _ = self._ray.wait(list(gens), num_returns=1, timeout=timeout_s)
        return list(done)

    def next_of(self, gen: Any) -> Any:
        """The next item of a task generator, or why the task ended without one (a str)."""
        try:
            return self._ray.get(next(gen))
        except StopIteration:
            return "the task ended without its result"
        except Exception as err:  # the task's error (its node died, it crashed)
            return _one_line(err)

    def cancel(self, gens: Sequence[Any]) -> None:
        """Cancel tasks: a KeyboardInterrupt in each running one (it stops what it started),
        queued ones never start."""
        for gen in gens:
            with contextlib.suppress(Exception):
                self._ray.cancel(gen)

    def probe(self, nodes: Sequence[NodeFacts],
              others: Sequence[NodeFacts] = ()) -> list[NodeProbe]:
        """What each node's Ray workers see: pretuner's version, the node variables, NICs. A
        failure on one of `nodes` is a ClusterError; `others` (nodes the ranks do not use,
        probed for the restart commands) are left out when their probe fails."""
        refs = [self.submit(n, probe_node, n.address) for n in (*nodes, *others)]
        results = self.gather(refs[: len(nodes)], nodes, "the node check", TASK_TIMEOUT_S)
        probed = list(zip(nodes, results, strict=True))
        for ref, node in zip(refs[len(nodes) :], others, strict=True):
            with contextlib.suppress(ClusterError):
                probed += [(node, self.gather([ref], [node], "the node check", TASK_TIMEOUT_S)[0])]
        return [NodeProbe(n, r["version"], r["env"], tuple(r["interfaces"]), r["address_nic"])
                for n, r in probed]


def check_address(address: str) -> None:
    """`auto` or a reachable HOST:PORT: `ray.init` waits for minutes on an unreachable head."""
    if address == "auto":
        return  # Ray finds the local head itself, and says so at once when there is none
    if "://" in address:
        raise BadInputError(
            f"--ray-address {address!r}: Ray Client addresses are not supported",
            hint="run pretuner on a node of the cluster and pass the head's HOST:PORT "
            "(the GCS port, 6379 by default) or auto",
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise BadInputError(f"--ray-address {address!r} is not HOST:PORT",
                            hint="e.g. --ray-address 10.0.0.1:6379")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ClusterError(
            f"cannot reach the Ray head at {address}: {err.strerror or err}",
            hint="start it with `ray start --head --port=6379` (or check the address and the "
            "firewall), then run pretuner on a node of that cluster",
        ) from None


def probe_node(address: str) -> dict[str, Any]:
    """Runs on the node: the version of pretuner its workers import and what they inherit."""
    import pretuner

    names = [name for _, name in socket.if_nameindex()]
    return {
        "version": pretuner.__version__,
        "env": {k: os.environ[k] for k in PROBED_VARS if k in os.environ},
        "interfaces": names,
        "address_nic": _interface_of(address, names),
    }


def _interface_of(address: str, names: Sequence[str]) -> str | None:
    """The interface that holds `address` (Linux ioctl SIOCGIFADDR), or None."""
    try:
        import fcntl
        import struct
    except ImportError:  # not Linux
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = struct.pack("256s", name.encode()[:15])
                raw = fcntl.ioctl(s.fileno(), 0x8915, packed)  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[-1] if text else type(err).__name__)[:300]
