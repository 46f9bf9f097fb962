"""vLLM V1's scheduler as a pure state machine: a token budget per step, KV blocks on demand.

`plan()` decides one step, `commit()` applies it once the memory check passed. Running requests
take the budget first, then waiting ones FCFS; blocks are allocated for the tokens computed,
and a request that finds none preempts the newest. With images, a chunk encodes the images it
reaches within the encoder budget and cache room, or stops before them
(`pretuner.sim.v1.mm.EncoderCache`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretuner.sim.loop import SchedulerBase, SeqBase, blocks_for
from pretuner.sim.v1.mm import MMItem, MMState


@dataclass(eq=False)  # a request is itself, not its fields' values (`SeqBase`)
class Req(SeqBase):
    """A V1 request: it may be preempted, and carry images."""

    mm: tuple[MMItem, ...] = ()  # its images, by offset
    encoded: set[str] = field(default_factory=set)  # images whose outputs it holds

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated


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
    encode: list[tuple[Req, MMItem]] = field(default_factory=list)  # run by the encoder
    hits: list[tuple[Req, MMItem]] = field(default_factory=list)  # found in the encoder cache
    encoder_left: int = 0  # encoder budget tokens left this step

    @property
    def encode_tokens(self) -> int:
        return sum(item.tokens for _, item in self.encode)

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


class Scheduler(SchedulerBase[Req]):
    def __init__(self, limits: Limits, mm: MMState | None = None) -> None:
        super().__init__(limits.num_blocks)
        self.limits = limits
        self.mm = mm

    def _preempt(self, victim: Req, plan: Plan) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        self._release(victim, everything=True)
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)

    def plan(self) -> Plan:
        lim = self.limits
        plan = Plan(encoder_left=self.mm.card.budget_tokens if self.mm else 0)
        budget = lim.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted for an older request in this loop
                continue
            n = self._fit_images(req, min(req.num_tokens - req.computed, budget), plan)
            if n <= 0:
                continue
            need = blocks_for(req.computed + n, lim.block_size) - req.blocks
            while need > self.free_blocks and self.running[-1] is not req:
                self._preempt(self.running[-1], plan)
            if need > self.free_blocks:
                self._preempt(req, plan)
                continue
            budget -= self._schedule(req, n, need, plan)
        while (not plan.preempted and self.waiting and budget > 0
               and len(self.running) < lim.max_num_seqs):
            req = self.waiting[0]
            n = self._fit_images(req, min(req.num_tokens - req.computed, budget), plan)
            if n <= 0:
                break
            need = blocks_for(req.computed + n, lim.block_size) - req.blocks
            if need > self.free_blocks:
                break
            self.running.append(self.waiting.popleft())
            budget -= self._schedule(req, n, need, plan)
        return plan

    def _schedule(self, req: Req, n: int, need: int, plan: Plan) -> int:
        """`n` tokens of `req` in this step, with the `need` blocks they take; returns `n`."""
        self.free_blocks -= need
        req.blocks += need
        plan.scheduled.append((req, n))
        return n

    def _fit_images(self, req: Req, n: int, plan: Plan) -> int:
        """`n`, or less: the chunk stops before the first image its step cannot encode."""
        if self.mm is None or not req.mm:
            return n
        cache = self.mm.encoder
        for item in req.mm:
            if item.offset >= req.computed + n:
                break
            if item.end <= req.computed or item.key in req.encoded:
                continue
            if item.key in cache.entries:
                cache.hold(item.key, req.request_id)
                plan.hits.append((req, item))
                continue
            if item.tokens > plan.encoder_left or not cache.room_for(item.tokens,
                                                                     plan.encode_tokens):
                return max(0, item.offset - req.computed)
            plan.encode.append((req, item))
            plan.encoder_left -= item.tokens
        return n

    def _release(self, req: Req, everything: bool = False) -> None:
        """Give back the encoder outputs whose positions `req` has computed (or all)."""
        if self.mm is None:
            return
        for item in req.mm:
            if item.key in req.encoded and (everything or item.end <= req.computed):
                self.mm.encoder.release(item.key, req.request_id)
                req.encoded.discard(item.key)

    def commit(self, plan: Plan) -> list[Req]:
        """Apply a step that ran; returns the requests it finished."""
        if self.mm is not None:
            for req, item in plan.encode:
                self.mm.encoder.add(item.key, item.tokens, req.request_id)
                req.encoded.add(item.key)
            for req, item in plan.hits:
                req.encoded.add(item.key)
            self.mm.encoded([item for _, item in plan.encode])
        finished = []
        for req, n in plan.scheduled:
            req.computed += n
            if req.computed >= req.num_tokens:
                req.generated += 1
            self._release(req, everything=req.done)
            if req.done:
                self.running.remove(req)
                self.free_blocks += req.blocks
                req.blocks = 0
                finished.append(req)
        return finished
