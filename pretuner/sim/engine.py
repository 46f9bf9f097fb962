"""The emulated r0.1 engine: V0 scheduling (`pretuner.sim.scheduler`) on a thread, each step
accounted in every rank's MindSpore pool.

A rank that cannot find a step's memory logs MindSpore's OOM and pool dump, every request in
flight fails and the engine is dead."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pretuner.sim.logs import PoolStats, RankLog, VllmLog
from pretuner.sim.loop import EngineDead, EngineThread, Throughput, Waiter
from pretuner.sim.memory import CardModel, Prefill
from pretuner.sim.scheduler import Scheduler, SchedulerLimits, Seq, StepPlan

PREFILL_BASE_S = 0.004
PREFILL_PER_TOKEN_S = 2e-7
DECODE_STEP_S = 0.003
METRICS_EVERY_S = 5.0
_POOL_CHUNK = 1 << 30  # MindSpore grows its dynamic pool in 1 GiB chunks


@dataclass(eq=False)
class Request(Waiter):
    """One completion request as the engine sees it (a token -2: ignored by the scheduler)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    output: list[int] = field(default_factory=list)


@dataclass
class RankPool:
    """One rank (its log, memory model, node and device) and its MindSpore pool: static part,
    KV, and the running peaks."""

    model: CardModel
    log: RankLog  # its rank and pid too
    device_id: int
    kv_bytes: int
    peak_dynamic: int = 0  # with fragments
    peak_dynamic_no_frag: int = 0
    node: int = 0

    @property
    def in_used(self) -> int:
        return self.model.static_bytes + self.kv_bytes

    def stats(self) -> PoolStats:
        actual = self.in_used + self.peak_dynamic
        peak = self.in_used + self.peak_dynamic_no_frag
        alloc = math.ceil(actual / _POOL_CHUNK) * _POOL_CHUNK
        return PoolStats(in_used=self.in_used, peak_used=peak, actual_peak=actual, alloc=alloc)


class OutOfMemory(Exception):
    """A rank's pool could not serve an allocation."""

    def __init__(self, rank: int, device_id: int, kernel: str, alloc_size: int) -> None:
        self.rank = rank  # the pool that dumps
        super().__init__(f"Device(id:{device_id}) memory isn't enough and alloc failed, kernel "
                         f"name: {kernel}, alloc size: {alloc_size}B.")


STEP_OOM = ("mindspore/ccsrc/runtime/pynative/op_runner.cc:585", "MallocForKernelOutput")
LOAD_OOM = ("mindspore/ccsrc/runtime/device/res_manager/memory_manager.cc:312",
            "MallocWorkSpaceDynamicMem")


def log_oom(log: RankLog, oom: OutOfMemory, stats: PoolStats, pool_format: str,
            where: tuple[str, str] = STEP_OOM) -> None:
    """MindSpore's lines when a rank's pool cannot serve an allocation: the error, the dump."""
    log.log("ERROR", "DEVICE", *where, f"#umsg#Memory not enough:#umsg#{oom}")
    log.pool_dump(stats, pool_format)


_PREFILL_KERNEL = ("Default/model-LlamaModel/layers-CellList/0-DecoderLayer/attention-Attention/"
                   "FlashAttentionScore-op0")


def check_step(pools: Sequence[RankPool], cap: int, prefill: Prefill, running: int) -> None:
    """Account one step on every rank; raise OutOfMemory on the first rank that cannot fit it."""
    for rank, pool in enumerate(pools):
        dyn = pool.model.dynamic_bytes(prefill, running)
        if pool.in_used + dyn > cap:
            over = pool.in_used + dyn - cap
            alloc = max(over, dyn // 4)
            alloc = -(-alloc // 512) * 512
            kernel = _PREFILL_KERNEL if prefill else "Default/lm_head-Linear/MatMul-op2"
            pool.peak_dynamic = max(pool.peak_dynamic, cap - pool.in_used)
            raise OutOfMemory(rank, pool.device_id, kernel, alloc)
    for pool in pools:
        pool.peak_dynamic = max(pool.peak_dynamic, pool.model.dynamic_bytes(prefill, running))
        pool.peak_dynamic_no_frag = max(pool.peak_dynamic_no_frag,
                                        pool.model.dynamic_bytes_no_frag(prefill, running))


class Engine(EngineThread[Request]):
    """Continuous batching over threads: requests really overlap in the same steps."""

    def __init__(self, pools: Sequence[RankPool], limits: SchedulerLimits, log: VllmLog,
                 on_dead: Callable[[OutOfMemory], None], *, pool_format: str = "2.5",
                 seed: int = 0) -> None:
        super().__init__("engine")
        self.pools = list(pools)
        self.pool_format = pool_format
        self.limits = limits
        self.log = log
        self._on_dead = on_dead
        self.sched = Scheduler(limits)
        self.dead: OutOfMemory | None = None
        self._rng = random.Random(seed)  # noqa: S311 - fake output tokens
        self.tally = Throughput(METRICS_EVERY_S)

    def submit(self, req: Request) -> None:
        with self._cond:
            if self.dead is not None:
                raise EngineDead("Background loop has errored already.")
            self._waiting[req.request_id] = req
            self.sched.add(Seq(req.request_id, req.prompt_len, req.max_tokens))
            self._cond.notify_all()

    def _next_plan(self) -> StepPlan | None:
        """The next step's plan once there is work; None when stopped."""
        with self._cond:
            while not self._stop and self.sched.idle:
                self._cond.wait(timeout=1.0)
            return None if self._stop else self.plan()

    def plan(self) -> StepPlan:
        """The scheduler's next step; the prompts it ignores are answered at once."""
        with self._cond:
            plan = self.sched.plan()
            for ignored in plan.ignored:
                self.log.warning("scheduler.py:1097", ignored.warning)
                req = self._waiting.pop(ignored.seq.request_id)
                req.done.set()
                req.tokens.put(-2)
            return plan

    def check(self, plan: StepPlan) -> bool:
        """Account the step in every rank's pool; False (the engine now dead) when a rank
        cannot fit it."""
        try:
            check_step(self.pools, self.limits.pool_cap_bytes, plan.prefill_shape(),
                       plan.running)
        except OutOfMemory as oom:
            pool = self.pools[oom.rank]
            log_oom(pool.log, oom, pool.stats(), self.pool_format)
            self._fail_all(oom, str(oom))
            self._on_dead(oom)
            return False
        return True

    def _loop(self) -> None:
        while (plan := self._next_plan()) is not None:
            if plan.empty:
                time.sleep(DECODE_STEP_S)  # waiting for KV blocks: nothing can run
                continue
            if not self._step(plan):
                return
            with self._cond:
                self.advance(plan)
                self.tally.prompt_tokens += plan.prefill_tokens
                self._maybe_metrics()

    def _step(self, plan: StepPlan) -> bool:
        """Run a step: account it in every rank's pool, take its time; False when it killed
        the engine."""
        if not self.check(plan):
            return False
        if plan.chunks:
            for pool in self.pools:
                pool.log.noise("step", 2)
        time.sleep(PREFILL_BASE_S + PREFILL_PER_TOKEN_S * plan.prefill_tokens if plan.chunks
                   else DECODE_STEP_S)
        return True

    def token(self, seq: Seq) -> int:
        """The token a step that ran sampled for `seq`: any, on the emulated card."""
        return self._rng.randrange(100, 30000)

    def advance(self, plan: StepPlan) -> list[Seq]:
        """Apply a step that ran: each request gets the tokens it sampled; returns those the
        step finished."""
        before = {s.request_id: s.generated for s in self.sched.running + plan.admitted}
        done = self.sched.commit(plan)
        for seq in self.sched.running + done:
            req = self._waiting[seq.request_id]
            for _ in range(seq.generated - before.get(seq.request_id, 0)):
                tok = self.token(seq)
                req.output.append(tok)
                self.tally.generated += 1
                req.tokens.put(tok)
        for seq in done:
            self._waiting.pop(seq.request_id).done.set()
        return done

    def _maybe_metrics(self) -> None:
        rates = self.tally.due()
        if rates is None:
            return
        usage = 100.0 * self.sched.used_blocks / self.limits.num_blocks \
            if self.limits.num_blocks else 0.0
        self.log.info(
            "metrics.py:467",
            f"Avg prompt throughput: {rates[0]:.1f} tokens/s, "
            f"Avg generation throughput: {rates[1]:.1f} tokens/s, "
            f"Running: {len(self.sched.running)} reqs, Swapped: 0 reqs, "
            f"Pending: {len(self.sched.waiting)} reqs, GPU KV cache usage: {usage:.1f}%, "
            f"CPU KV cache usage: 0.0%.")

    def _fail_all(self, dead: OutOfMemory, error: str) -> None:
        with self._cond:
            self.dead = dead
            self.sched.abort_all()
        self._fail_waiting(error)
