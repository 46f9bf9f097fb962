"""Device memory on every node of a launch: one small Ray actor per node runs the engine's own
reader there (NVML, nvidia-smi, npu-smi, or the emulated card) in `MemorySampler` at its 20 ms,
is told each phase as the launch goes, and ships its peaks back when the launch stops.

`NodeSamplers` has `MemorySampler`'s shape (`wrap`, `start`, `stop`, the live "memory" status
line), so a launch samples a cluster as it samples one machine; its `Sampled` is the worst
node's, with each node's peak beside it (`node_peaks_mib`, by node label)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pretuner.cluster.nodes import NodeFacts, Placement
from pretuner.cluster.ray_api import RayCluster
from pretuner.errors import ClusterError
from pretuner.launch.sampler import STATUS_EVENTS, STATUS_EVERY_S, MemorySampler, Phase, Sampled

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # how long a node's sampler may take to ship its peaks
# How long a node's sampler may take to start (a Ray worker process on a busy node): the
# launch waits for it, since a peak reached before a node's sampler runs is never seen.
START_TIMEOUT_S = 120.0
FIRST_SAMPLE_S = 10.0  # within that, a node's sampler has read its devices once


class NodeSampler:
    """Runs in a Ray actor on one node: the engine's reader of the node's first `count`
    devices, sampled in the background."""

    def __init__(self, kind: str, env: Mapping[str, str], count: int) -> None:
        from pretuner.devices import select_reader

        # The node's own environment (its `ray start`), plus the launch's for the reader.
        reader = select_reader(kind, {**os.environ, **env}, count)
        self.sampler = MemorySampler(reader)
        self.tag = self.sampler.wrap(lambda name, detail: None)
        self.current = "launch"  # the phase being sampled
        self.sampler.start()

    def running(self) -> int:
        """The samples taken, once the first is (or the reader failed, or there is none):
        the launch waits for this."""
        deadline = time.monotonic() + FIRST_SAMPLE_S
        while True:
            got = self.sampler.snapshot()
            if (got.samples or got.failure or self.sampler.reader is None
                    or time.monotonic() > deadline):
                return got.samples
            time.sleep(0.01)

    def phase(self, name: str) -> Sampled:
        """A new phase: the peaks up to the end of the last one go back, without the time
        series (small: Ray keeps it with the caller, so it outlives this node)."""
        shipped = replace(self.sampler.snapshot(), series=())
        self.tag(name, "")
        self.current = name
        return shipped

    def now(self) -> tuple[int | None, int | None, str | None]:
        """(MiB used at the last sample of this phase, the launch's peak so far, the reader)."""
        got = self.sampler.snapshot()
        return got.last_mib.get(self.current), got.peak_mib, got.reader

    def stop(self) -> Sampled:
        return self.sampler.stop()


class NodeSamplers:
    """The launch's samplers, one per node of the placement (`MemorySampler`'s interface)."""

    def __init__(self, cluster: RayCluster, placement: Placement, kind: str,
                 env: Mapping[str, str], status: Phase | None = None) -> None:
        self.cluster, self.placement = cluster, placement
        self.kind, self.env = kind, dict(env)
        self.status = status  # told the memory seen so far on the worst node, as on one machine
        self._quiet = threading.Event()
        self._teller: threading.Thread | None = None
        self.actors: list[Any] = []
        # per node: (phase begun, a ref to its peaks until then), one per phase
        self.shipped: list[list[tuple[str, Any]]] = []

    def wrap(self, phase: Phase) -> Phase:
        def tagged(name: str, detail: str) -> None:
            if name not in STATUS_EVENTS:
                # In order after the actor's start; not waited for
                for refs, actor in zip(self.shipped, self.actors, strict=True):
                    refs.append((name, actor.phase.remote(name)))
            phase(name, detail)

        return tagged

    def start(self) -> NodeSamplers:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self.cluster._ray
        actor = ray.remote(num_cpus=0, max_restarts=0)(NodeSampler)
        for node, count in zip(self.placement.nodes, self.placement.ranks_per_node, strict=True):
            strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            self.actors.append(actor.options(scheduling_strategy=strategy)
                               .remote(self.kind, self.env, count))
            self.shipped.append([])
        self._wait_running()
        if self.status is not None:
            self._teller = threading.Thread(target=self._tell, args=(self.status,),
                                            name="cluster-memory-status", daemon=True)
            self._teller.start()
        return self

    def _tell(self, status: Phase) -> None:
        """Every STATUS_EVERY_S, the node that uses the most now, as one machine's sampler says
        it; a node that does not answer in time is left out of that line (`stop` names a dead
        one)."""
        ray, labels = self.cluster._ray, [node.label for node in self.placement.nodes]
        while not self._quiet.wait(STATUS_EVERY_S):
            refs = [actor.now.remote() for actor in self.actors]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=STATUS_EVERY_S)
            seen = []
            for ref, label in zip(refs, labels, strict=False):
                if ref in done:
                    try:
                        used, peak, reader = ray.get(ref, timeout=0)
                    except Exception as err:  # the node's actor died: stop() says so
                        log.debug("no memory status from node %s: %s", label, err)
                        continue
                    if used is not None and peak is not None:
                        seen.append((used, label, peak, reader))
            if seen and not self._quiet.is_set():
                used, label, _, reader = max(seen)
                how = " (simulated)" if reader == "emulated" else ""
                status("memory", f"{used:,} MiB used now on node {label}, peak "
                       f"{max(peak for _, _, peak, _ in seen):,} MiB this launch ({reader}{how}, "
                       f"{len(seen)} of {len(labels)} node(s))")

    def _wait_running(self) -> None:
        """Every node's sampler runs, or a ClusterError names the node that did not start
        one (the actors are gone then)."""
        ray = self.cluster._ray
        refs = [actor.running.remote() for actor in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT_S)
        for ref, node in zip(refs, self.placement.nodes, strict=True):
            try:
                ray.get(ref, timeout=0)
            except Exception as err:  # its __init__ raised, the node died, or it still
                # waits for a worker process
                for actor in self.actors:
                    ray.kill(actor)
                self.actors = []
                dead = {n.node_id for n in self.cluster.nodes() if not n.alive}
                if node.node_id in dead:  # it died while its sampler started
                    raise node_died([self._ranks(node)]) from err
                why = (str(err).strip() or type(err).__name__).splitlines()[-1][:300]
                raise ClusterError(
                    f"the device sampler did not start on node {node.label} within "
                    f"{START_TIMEOUT_S:.0f} s: {why}",
                    hint="install the same pretuner (with the `ray` extra) on every node, in "
                    "the Python environment that runs `ray start`; `ray status` shows the "
                    "node alive") from err

    def stop(self) -> Sampled:
        """Every node's peaks; the actors are gone afterwards, whatever happened. A node whose
        actor died (the node died, or its raylet) is a ClusterError naming it and its ranks:
        the launch's figures lack a node, and the run stops, resumable once it is back."""
        ray = self.cluster._ray
        self._quiet.set()
        if self._teller is not None:
            self._teller.join(3 * STATUS_EVERY_S)
        got: list[tuple[str, Sampled]] = []
        lost: list[str] = []
        for k, (actor, node) in enumerate(zip(self.actors, self.placement.nodes, strict=False)):
            try:
                got.append((node.label, ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S)))
            except Exception as err:  # a dead node's actor, a timeout (start saw it run)
                log.warning("device sampling on node %s: %s", node.label, type(err).__name__)
                lost.append(self._ranks(node, self._last_peak(k)))
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if lost:
            raise node_died(lost)
        return merge_sampled(got)

    def _ranks(self, node: NodeFacts, peak: str = "") -> str:
        """`LABEL (ranks A-B[, peak ...])`: a node as a lost-node error names it."""
        first, count = next((start, n) for each, start, n in self.placement.spans()
                            if each.node_id == node.node_id)
        return f"{node.label} (ranks {first}-{first + count - 1}{peak})"

    def _last_peak(self, k: int) -> str:
        """`, peak N MiB before phase P`: the latest peaks node `k` shipped before it died."""
        for phase, ref in reversed(self.shipped[k] if k < len(self.shipped) else []):
            if not self.cluster.ready([ref]):
                continue
            try:
                peak = self.cluster._ray.get(ref, timeout=0).peak_mib
            except Exception as err:  # asked of the actor after it died
                log.debug("no peaks shipped by node %d: %s", k, type(err).__name__)
                continue
            return "" if peak is None else f", peak {peak:,} MiB before phase {phase}"
        return ""


def node_died(lost: list[str]) -> ClusterError:
    """The error of a launch that lost nodes (each named with its ranks): resumable."""
    return ClusterError(
        f"node {', '.join(lost)} died during the launch (its device sampler is gone): "
        "the server was stopped on every node",
        hint="bring the node back into the Ray cluster (`ray start --address=HEAD_IP:PORT` "
        "there, `ray status` shows it), then continue with `pretuner run --resume RUN_DIR`")


def merge_sampled(nodes: list[tuple[str, Sampled]]) -> Sampled:
    """One launch's sampling over every node (pure): each phase's worst device anywhere, the
    smallest device's total, every node's own peak; the head's time series."""
    peaks: dict[str, int] = {}
    last: dict[str, int] = {}
    for _, s in nodes:
        for phase, mib in s.peaks_mib.items():
            peaks[phase] = max(peaks.get(phase, mib), mib)
        for phase, mib in s.last_mib.items():
            last[phase] = max(last.get(phase, mib), mib)
    totals = [s.total_mib for _, s in nodes if s.total_mib is not None]
    failures = [f"{label}: {s.failure}" for label, s in nodes if s.failure]
    readers = {s.reader for _, s in nodes if s.reader}
    head = nodes[0][1] if nodes else Sampled(None)
    return replace(
        head, reader=next(iter(readers), None), peaks_mib=peaks, last_mib=last,
        samples=sum(s.samples for _, s in nodes), total_mib=min(totals, default=None),
        failure="; ".join(failures) or None,
        node_peaks_mib={label: s.peak_mib for label, s in nodes if s.peak_mib is not None})
