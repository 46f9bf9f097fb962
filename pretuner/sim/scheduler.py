"""vLLM 0.6 (V0) scheduling as a pure state machine: admission, KV blocks, chunked prefill.

`plan()` decides one step, `commit()` applies it once the memory check passed; the threaded
`Engine` and the in-process run step the same object. As in vLLM 0.6.6: FCFS admission, a 1 %
block watermark (a prompt that could never fit beside it is ignored with vLLM's warning and
answered empty), prompts over the limit ignored, whole-prompt or decode-only steps unless
chunked prefill spends the budget on decodes first, and preemption by recompute."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretuner.sim.loop import SchedulerBase, SeqBase, blocks_for

WATERMARK = 0.01


def watermark_blocks(num_blocks: int) -> int:
    return int(WATERMARK * num_blocks)


@dataclass(eq=False)  # a request is itself, not its fields' values (`SeqBase`)
class Seq(SeqBase):
    """A V0 sequence: `computed` counts the prompt tokens already prefilled."""

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prefill work of one sequence in one step: `tokens` new tokens over `context` in all."""

    seq: Seq
    tokens: int
    context: int


@dataclass(frozen=True, slots=True)
class Ignored:
    seq: Seq
    warning: str


@dataclass
class StepPlan:
    """What one engine step runs; `running` counts every sequence the step holds."""

    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[Seq] = field(default_factory=list)
    admitted: list[Seq] = field(default_factory=list)
    ignored: list[Ignored] = field(default_factory=list)
    running: int = 0

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decodes

    @property
    def prefill_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def prefill_shape(self) -> list[tuple[int, int]]:
        """(new tokens, context) per prompt chunk: what the memory model charges."""
        return [(c.tokens, c.context) for c in self.chunks]


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    chunked_prefill: bool = False
    pool_cap_bytes: int = 0  # the engine's MindSpore pool (the scheduler ignores it)

    @property
    def prompt_limit(self) -> int:
        if self.chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)


def capacity_warning(prompt_len: int) -> str:
    return (f"Input prompt ({prompt_len} tokens) is too long and exceeds the capacity of "
            "block_manager")


def limit_warning(prompt_len: int, limit: int) -> str:
    return f"Input prompt ({prompt_len} tokens) is too long and exceeds limit of {limit}"


class Scheduler(SchedulerBase[Seq]):
    """The V0 scheduler and block manager of one engine."""

    def __init__(self, limits: SchedulerLimits) -> None:
        super().__init__(limits.num_blocks)
        self.limits = limits
        self.watermark = watermark_blocks(limits.num_blocks)

    def _can_allocate(self, seq: Seq) -> str:
        need = blocks_for(seq.prompt_len, self.limits.block_size)
        if self.limits.num_blocks - need < self.watermark:
            return "never"
        if self.free_blocks - need < self.watermark:
            return "later"
        return "ok"

    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Admit waiting prompts FCFS within the token budget; returns the budget left."""
        lim = self.limits
        while self.waiting:
            seq = self.waiting[0]
            if seq.prompt_len > lim.prompt_limit:
                self.waiting.popleft()
                plan.ignored.append(Ignored(seq, limit_warning(seq.prompt_len, lim.prompt_limit)))
                continue
            status = self._can_allocate(seq)
            if status == "never":
                self.waiting.popleft()
                plan.ignored.append(Ignored(seq, capacity_warning(seq.prompt_len)))
                continue
            if status == "later":
                break
            if len(self.running) + len(plan.admitted) >= lim.max_num_seqs:
                break
            remaining = seq.prompt_len - seq.computed
            tokens = min(remaining, budget) if lim.chunked_prefill else remaining
            if tokens <= 0 or tokens > budget:
                break
            self.waiting.popleft()
            seq.blocks = blocks_for(seq.prompt_len, lim.block_size)
            self.free_blocks -= seq.blocks
            plan.admitted.append(seq)
            plan.chunks.append(Chunk(seq, tokens, seq.computed + tokens))
            budget -= tokens
        return budget

    def _grow(self, plan: StepPlan) -> None:
        """Give every decoding sequence the block its next token needs, preempting if none."""
        for seq in list(plan.decodes):
            if seq not in plan.decodes:
                continue  # preempted below
            need = blocks_for(seq.prompt_len + seq.generated, self.limits.block_size)
            while need > seq.blocks and self.free_blocks <= 0:
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq in plan.decodes and need > seq.blocks:
                self.free_blocks -= need - seq.blocks
                seq.blocks = need

    def _preempt(self, seq: Seq, plan: StepPlan) -> None:
        self.running.remove(seq)
        if seq in plan.decodes:
            plan.decodes.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks, seq.computed = 0, 0  # recompute: the prompt again, the output is kept
        self.waiting.appendleft(seq)

    def plan(self) -> StepPlan:
        """Decide the next step (admission already reserves the admitted prompts' blocks)."""
        plan = StepPlan()
        lim = self.limits
        if lim.chunked_prefill:
            budget = lim.max_num_batched_tokens
            plan.decodes = [s for s in self.running if not s.prefilling][:budget]
            self._grow(plan)
            budget -= len(plan.decodes)
            for seq in [s for s in self.running if s.prefilling]:
                if budget <= 0:
                    break
                tokens = min(seq.prompt_len - seq.computed, budget)
                plan.chunks.append(Chunk(seq, tokens, seq.computed + tokens))
                budget -= tokens
            if budget > 0:
                self._admit(plan, budget)
        else:
            self._admit(plan, lim.max_num_batched_tokens)
            if not plan.chunks:
                plan.decodes = list(self.running)
                self._grow(plan)
        plan.running = len(self.running) + len(plan.admitted)
        return plan

    def commit(self, plan: StepPlan) -> list[Seq]:
        """Apply a step that ran; returns the sequences it finished."""
        self.running.extend(plan.admitted)
        sampled: list[Seq] = list(plan.decodes)
        for chunk in plan.chunks:
            chunk.seq.computed = chunk.context
            if not chunk.seq.prefilling:
                sampled.append(chunk.seq)  # the last chunk samples the first output token
        for seq in sampled:
            seq.generated += 1
        done = [s for s in self.running if s.done]
        for seq in done:
            self.running.remove(seq)
            self.free_blocks += seq.blocks
        return done

    def abort_all(self) -> None:
        self.waiting.clear()
        self.running.clear()
