"""The emulated V1 engine: `EngineCore` steps the scheduler and checks each step's memory
(synchronous, shared with the in-process run); `Engine` runs it on the server's thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pretuner.sim.loop import EngineDead, EngineThread, Throughput, Waiter
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.boot import Booted
from pretuner.sim.v1.memory import Alloc, first_failure, peak_of
from pretuner.sim.v1.mm import MMState, pixel_bytes
from pretuner.sim.v1.scheduler import Limits, Plan, Req, Scheduler


@dataclass(frozen=True, slots=True)
class StepResult:
    finished: list[Req]
    peak_bytes: int  # process memory at the step's peak
    tokens: int
    prefill_tokens: int = 0
    sampled: tuple[Req, ...] = ()  # the requests that sampled a token


METRICS_S = 10.0  # vLLM logs its throughput line every 10 s


class EngineCore:
    def __init__(self, booted: Booted, log: L.V1Log) -> None:
        self.b = booted
        self.log = log
        self.mm = MMState(booted.vision, booted.processor_cache_bytes) if booted.vision else None
        self.sched = Scheduler(Limits(booted.max_num_seqs, booted.card.batched_tokens,
                                      booted.card.block_size, booted.num_blocks), self.mm)
        self.reserved = booted.reserved_bytes
        self.dead: str | None = None

    def add(self, req: Req) -> None:
        """A request in, once the API server's processor ran on each of its images."""
        if self.mm is not None:
            for item in req.mm:
                self.mm.processed(item.key, pixel_bytes(self.mm.card.vision, item.tokens))
        self.sched.add(req)

    @property
    def held_bytes(self) -> int:
        """What images left on the card: the encoder cache's high-water mark, stranded blocks."""
        return self.mm.held_bytes() if self.mm is not None else 0

    @property
    def level_bytes(self) -> int:
        return self.b.fixed_bytes + self.held_bytes + self.reserved

    def step(self) -> StepResult | None:
        """One step (a fatal one sets `dead` and prints its lines); None when there is
        nothing to run."""
        if self.sched.idle or self.dead is not None:
            return None
        plan: Plan = self.sched.plan()
        if not plan.scheduled:
            return StepResult([], self.level_bytes, 0)
        b = self.b
        allocs = b.card.step(plan.tokens, plan.rows)
        held = self.held_bytes
        if self.mm is not None and plan.encode:
            # The encoder runs first, its transient freed before the language model's step;
            # its outputs stay in the encoder cache through that step.
            held = self.mm.held_bytes(plan.encode_tokens)
            allocs = [Alloc("encoder", 0, self.mm.card.activation_bytes(plan.encode_tokens)),
                      *allocs]
        bad = first_failure(allocs, self.reserved, b.room_bytes - held)
        if bad is not None:
            in_use = b.fixed_bytes + held + max(self.reserved, bad.live_before)
            self.dead = L.oom_text(
                gpu=0, alloc=bad.size, total=b.total_bytes, free=b.capacity_bytes - in_use,
                in_use=in_use, non_torch=b.non_torch_bytes, private=b.private_bytes,
                unallocated=max(0, self.reserved - bad.live_before) + int(0.2 * bad.size)
                + (self.mm.frag_bytes if self.mm is not None else 0))
            self._print_fatal(plan.tokens, 2 * b.card.spec.intermediate_size // b.card.tp)
            return StepResult([], in_use, plan.tokens)
        peak = max(self.reserved, peak_of(allocs))
        self.reserved = peak
        prefill = plan.prefill_tokens
        sampled = tuple(r for r, n in plan.scheduled if r.computed + n >= r.num_tokens)
        finished = self.sched.commit(plan)
        return StepResult(finished, b.fixed_bytes + held + peak, plan.tokens, prefill, sampled)

    def _print_fatal(self, tokens: int, gate_up_width: int) -> None:
        """What the real server prints when a step dies: input dump, traceback, dead handler."""
        log, sched = self.log, self.sched
        log.core("dump_input.py:72", f"Dumping input data for V1 LLM engine (v{L.VERSION})",
                 level="ERROR")
        log.core("dump_input.py:79", "Dumping scheduler output for model execution: "
                 f"SchedulerOutput(total_num_scheduled_tokens={tokens})", level="ERROR")
        log.core("dump_input.py:81", f"Dumping scheduler stats: SchedulerStats(num_running_reqs="
                 f"{len(sched.running)}, num_waiting_reqs={len(sched.waiting)}, kv_cache_usage="
                 f"{sched.used_blocks / max(1, sched.limits.num_blocks)})", level="ERROR")
        log.block(L.CORE, "ERROR", L.WHERE_FATAL,
                  L.fatal_step_lines(self.dead or "", gate_up_width))
        log.block(L.API, "ERROR", "async_llm.py:704", L.dead_handler_lines())


@dataclass(eq=False)
class Pending(Waiter):
    req: Req  # its tokens: the count generated as each one is sampled


class Engine(EngineThread[Pending]):
    """The core in a thread: the HTTP handlers submit and wait."""

    def __init__(self, core: EngineCore, level: Callable[[int], None],
                 time_scale: float) -> None:
        super().__init__("engine-core")
        self.core = core
        self._level = level
        self._time_scale = time_scale  # PRETUNER_SIM_TIME_SCALE
        self.tally = Throughput(METRICS_S)

    @property
    def dead(self) -> bool:
        return self.core.dead is not None

    def submit(self, req: Req) -> Pending:
        with self._cond:
            if self.dead:
                raise EngineDead(L.ENGINE_DEAD)
            p = Pending(req)
            self._waiting[req.request_id] = p
            self.core.add(req)
            self._cond.notify_all()
            return p

    def reset_mm_cache(self) -> None:
        """`/reset_mm_cache`: vLLM empties the processor cache (host memory) only."""
        with self._cond:
            if self.core.mm is not None:
                self.core.mm.reset()

    def _loop(self) -> None:
        last = self.core.level_bytes
        while True:
            with self._cond:
                while not self._stop and (self.core.sched.idle or self.dead):
                    self._cond.wait()
                if self._stop:
                    return
                result = self.core.step()
            if result is None:
                continue
            if self.dead:
                self._level(result.peak_bytes)
                self._fail_waiting(L.ENGINE_DEAD)
                continue
            if result.peak_bytes != last:
                self._level(result.peak_bytes)
                last = result.peak_bytes
            time.sleep(self.core.b.clock.step_seconds(result.tokens) * self._time_scale)
            self._metrics(result)
            for req in result.sampled:  # a streaming reply sends each token as it comes
                with self._cond:
                    sampled = self._waiting.get(req.request_id)
                if sampled is not None:
                    sampled.tokens.put(req.generated)
            for req in result.finished:
                with self._cond:
                    p = self._waiting.pop(req.request_id, None)
                if p is not None:
                    p.done.set()

    def _metrics(self, result: StepResult) -> None:
        """vLLM's periodic `Engine 000: ...` line, every METRICS_S while there is work."""
        self.tally.prompt_tokens += result.prefill_tokens
        self.tally.generated += len(result.sampled)
        rates = self.tally.due()
        if rates is None:
            return
        sched = self.core.sched
        usage = 100 * sched.used_blocks / max(1, sched.limits.num_blocks)
        self.core.log.api("loggers.py:273", f"Engine 000: Avg prompt throughput: "
                          f"{rates[0]:.1f} tokens/s, Avg generation throughput: {rates[1]:.1f} "
                          f"tokens/s, Running: {len(sched.running)} reqs, Waiting: "
                          f"{len(sched.waiting)} reqs, GPU KV cache usage: {usage:.1f}%, "
                          "Prefix cache hit rate: 0.0%")
