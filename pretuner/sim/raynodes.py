"""The emulated server's ranks on a Ray cluster: one actor per node writes its ranks' logs there.

Like vLLM's Ray executor, the server is the driver: it places the ranks (one NPU each, its own
node first) and keeps the engine; what a rank prints goes to the actor on its node, written
with that node's environment, so a dump appears only where the rank lives. A dead actor fails
`/health`; at a stop the actors write the teardown dumps and the driver kills them.

The lines go in batches (one Ray call per node every FLUSH_EVERY_S): one call per line left a
1-CPU node's actor tens of seconds behind after a wide load, and the stop's wait for it ran
out before the dumps were written."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pretuner.cluster.nodefs import node_local
from pretuner.cluster.nodes import Placement, place
from pretuner.sim.logs import RankLog
from pretuner.sim.state import STATE_DIR_ENV, Published, state_dir

PLACEMENT_TIMEOUT_S = 60.0  # vLLM waits 1800 s for its placement group; tests cannot
HEALTH_EVERY_S = 1.0
CLOSE_TIMEOUT_S = 30.0
FLUSH_EVERY_S = 0.1

Call = tuple[int, str, tuple[Any, ...]]  # (rank, RankLog method, its arguments)


NAMESPACE = "pretuner-sim"


def agent_name(server_pid: int, node_index: int) -> str:
    """The Ray name of a server's actor on its `node_index`-th node (tests kill one by it)."""
    return f"server-{server_pid}-node{node_index}"


class PlacementFailed(Exception):
    """The ranks cannot be placed; the text is what vLLM would raise."""


class NodeAgent:
    """Runs in a Ray actor on one node: the logs of the ranks placed there."""

    def __init__(self, ranks: Sequence[tuple[int, int, int]]) -> None:
        env = os.environ  # this worker's: the node's `ray start` plus the launch's runtime env
        log_dir = None
        if env.get("GLOG_logtostderr", "1") == "0" and env.get("GLOG_log_dir"):  # noqa: SIM112
            log_dir = node_local(env["GLOG_log_dir"])  # noqa: SIM112 - MindSpore spells it so
        # Without a log folder MindSpore writes to stderr: Ray's worker log on this node.
        self.logs = {rank: RankLog(rank, pid, tid, log_dir) for rank, pid, tid in ranks}

    def calls(self, batch: Sequence[Call]) -> None:
        for rank, method, args in batch:
            getattr(self.logs[rank], method)(*args)

    def close(self) -> None:
        for log in self.logs.values():
            log.close()

    def ping(self) -> bool:
        return True


class GpuAgent:
    """Runs in a Ray actor on one node: the GPUs Ray gave a V1 server's ranks there, their
    memory published in that node's emulated card state (what its nvidia-smi reads)."""

    def __init__(self, ranks: Sequence[int], state: str | None) -> None:
        import ray

        # `ranks`: the node's share, as RayRanks places them; the GPUs are Ray's to give
        self.gpus = [int(g) for g in ray.get_gpu_ids()]
        self.ip = ray.util.get_node_ip_address()
        # The driver's state folder, on this node's own disk (its own root, if it has one)
        env = {**os.environ, **({STATE_DIR_ENV: state} if state else {})}
        self.state: Path = state_dir(env)
        self.files = Published()

    def whoami(self) -> tuple[int, str, list[int]]:
        return os.getpid(), self.ip, self.gpus

    def level(self, mib: int) -> None:
        for gpu in self.gpus:
            self.files.hold(self.state, "cuda", 0, gpu, mib)

    def close(self) -> None:
        self.files.remove()

    def ping(self) -> bool:
        return True


class Outbox:
    """The lines bound for one node's actor, sent in order by one sender at a time."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._lines: list[Call] = []
        self._lock = threading.Lock()
        self._send = threading.Lock()  # Ray keeps one caller's calls in order: one at a time

    def put(self, call: Call) -> None:
        with self._lock:
            self._lines.append(call)

    def flush(self) -> None:
        with self._send:
            with self._lock:
                batch, self._lines = self._lines, []
            if batch:
                self.agent.calls.remote(batch)


class RemoteRankLog(RankLog):
    """A rank's lines, written by the actor on the rank's node with that node's GLOG_v (sent
    by `RayRanks` in batches; `RayRanks.close` sends the rest, waits for them and closes the
    files)."""

    def __init__(self, outbox: Outbox, rank: int, pid: int, tid: int) -> None:  # no files here
        self.outbox = outbox
        self.rank = rank
        self.pid = pid
        self.tid = tid

    def log(self, level: str, module: str, src: str, func: str, msg: str) -> None:
        self.outbox.put((self.rank, "log", (level, module, src, func, msg)))

    def py(self, level: str, msg: str, src: str = "mindspore/context.py:1052") -> None:
        self.outbox.put((self.rank, "py", (level, msg, src)))

    def close(self) -> None:
        """Files are closed by the actor at `RayRanks.close`."""


class RayRanks:
    """The driver's side: placement, one actor per node, health, and the stop."""

    def __init__(self, address: str, ranks: Sequence[Any], resource: str = "NPU",
                 agent: type = NodeAgent, args: tuple[Any, ...] = ()) -> None:
        """`ranks` as `agent` takes them: r0.1's (rank, pid, tid), a V1 server's rank numbers
        (`GpuAgent`, one `GPU` each); `args` follow them."""
        from pretuner.cluster.ray_api import RayCluster
        from pretuner.errors import ClusterError

        # the launch's job runtime env applies
        self.cluster = RayCluster.connect(address, resource)
        self._ray = self.cluster._ray
        self.lost: str | None = None
        self._stop = threading.Event()
        try:
            self.placement: Placement = place(self.cluster.nodes(), len(ranks), unit=resource)
        except ClusterError as err:
            self.cluster.close()
            raise PlacementFailed(
                f"The number of required {resource}s exceeds the total number of available "
                f"{resource}s in the placement group ({err.message})"
            ) from None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self._ray.remote(num_cpus=0, max_restarts=0)(agent)
        self.agents: list[Any] = []
        self.outboxes: list[Outbox] = []
        self.logs: list[RemoteRankLog] = []
        for k, (node, first, count) in enumerate(self.placement.spans()):
            mine = list(ranks[first : first + count])
            held = {"num_gpus": count} if resource == "GPU" else {"resources": {resource: count}}
            one = actor.options(
                name=agent_name(os.getpid(), k),
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                **held,
            ).remote(mine, *args)
            self.agents.append(one)
            if agent is NodeAgent:
                self.outboxes.append(Outbox(one))
                self.logs += [RemoteRankLog(self.outboxes[-1], r, pid, tid)
                              for r, pid, tid in mine]
        try:
            self._ray.get([a.ping.remote() for a in self.agents], timeout=PLACEMENT_TIMEOUT_S)
        except Exception as err:  # a timeout or a failed actor
            self.close()
            raise PlacementFailed(
                f"Cannot provide a placement group of {len(ranks)} {resource} bundles within "
                f"{PLACEMENT_TIMEOUT_S:.0f} seconds ({type(err).__name__}). Check `ray status` "
                "to see if you have enough resources."
            ) from None
        threading.Thread(target=self._sender, name="ray-logs", daemon=True).start()

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Ping every actor in the background; report the first one that died."""

        def loop() -> None:
            while not self._stop.wait(HEALTH_EVERY_S):
                for agent, (node, first, count) in zip(self.agents, self.placement.spans(),
                                                       strict=True):
                    try:
                        self._ray.get(agent.ping.remote(), timeout=10)
                    except Exception as err:  # RayActorError, timeouts
                        if self._stop.is_set():
                            return
                        self.lost = (
                            f"At least one Worker is dead. Dead Workers: node {node.label} "
                            f"ranks {first}-{first + count - 1} ({type(err).__name__})"
                        )
                        on_lost(self.lost)
                        return

        threading.Thread(target=loop, name="ray-health", daemon=True).start()

    def _sender(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            for box in self.outboxes:
                box.flush()

    def close(self) -> None:
        """Let every actor write what it was sent and close its files, then kill them."""
        self._stop.set()
        for box in self.outboxes:
            box.flush()
        with contextlib.suppress(Exception):  # a dead actor has nothing left to write
            self._ray.get([a.close.remote() for a in self.agents], timeout=CLOSE_TIMEOUT_S)
        for agent in self.agents:
            self._ray.kill(agent)
        self.agents = []
        self.cluster.close()
