"""vLLM V1's scheduler as a pure state machine: a token budget per step, KV blocks on demand.

No threads, no clocks: `plan()` decides one step, `commit()` applies it once the memory check
passed. The threaded engine of the HTTP server and the in-process run step the same object.

The rules kept from V1 (what decides memory and admission; prefix caching is left out):
- One budget of `max_num_batched_tokens` tokens per step. Running requests go first (a decode
  takes one token, an unfinished prefill its next chunk), then waiting ones in FCFS order while
  fewer than `max_num_seqs` run. A prompt longer than the budget is chunked over steps.
- KV blocks are allocated for the tokens a step computes. A running request that finds no free
  block preempts the newest running request (its blocks freed, recomputed later from its
  prompt and what it generated); a waiting request that finds none waits. Nothing is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class Req:
    """One request as the scheduler tracks it."""

    request_id: str
    prompt_len: int
    max_tokens: int
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.max_tokens


@dataclass(frozen=True, slots=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int


@dataclass
class Plan:
    """One step: tokens scheduled per request, and the requests preempted to make room."""

    scheduled: list[tuple[Req, int]] = field(default_factory=list)
    preempted: list[Req] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def rows(self) -> int:
        """Requests that sample a token this step."""
        return sum(1 for r, n in self.scheduled if r.computed + n >= r.num_tokens)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for r, n in self.scheduled if r.computed < r.prompt_len)


class Scheduler:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.free_blocks = limits.num_blocks

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _preempt(self, victim: Req, plan: Plan) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)

    def plan(self) -> Plan:
        lim = self.limits
        plan = Plan()
        budget = lim.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted for an older request in this loop
                continue
            n = min(req.num_tokens - req.computed, budget)
            if n <= 0:
                continue
            need = blocks_for(req.computed + n, lim.block_size) - req.blocks
            while need > self.free_blocks and self.running[-1] is not req:
                self._preempt(self.running[-1], plan)
            if need > self.free_blocks:
                self._preempt(req, plan)
                continue
            self.free_blocks -= need
            req.blocks += need
            plan.scheduled.append((req, n))
            budget -= n
        while (not plan.preempted and self.waiting and budget > 0
               and len(self.running) < lim.max_num_seqs):
            req = self.waiting[0]
            n = min(req.num_tokens - req.computed, budget)
            need = blocks_for(req.computed + n, lim.block_size) - req.blocks
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            req.blocks += need
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n
        return plan

    def commit(self, plan: Plan) -> list[Req]:
        """Apply a step that ran; returns the requests it finished."""
        finished = []
        for req, n in plan.scheduled:
            req.computed += n
            if req.computed >= req.num_tokens:
                req.generated += 1
            if req.done:
                self.running.remove(req)
                self.free_blocks += req.blocks
                req.blocks = 0
                finished.append(req)
        return finished

    def used_blocks(self) -> int:
        return self.limits.num_blocks - self.free_blocks
