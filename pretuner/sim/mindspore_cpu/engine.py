"""The emulated r0.1 engine's scheduling (`pretuner.sim.scheduler`) over a real MindSpore network.

Prefills of one step run one after the other, decodes DECODE_BATCH at a time (one batched
forward pays MindSpore's per-op dispatch once). A MindSpore allocation failure kills the
engine like vLLM's AsyncEngineDeadError."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from pretuner.sim.engine import Engine, OutOfMemory
from pretuner.sim.logs import VllmLog
from pretuner.sim.mindspore_cpu.network import Seq, TinyLM
from pretuner.sim.scheduler import SchedulerLimits, StepPlan
from pretuner.sim.scheduler import Seq as SchedSeq

log = logging.getLogger(__name__)

DECODE_BATCH = 16


class MsEngine(Engine):
    """The emulated engine's queues and admission, stepping a real MindSpore network."""

    def __init__(self, net: TinyLM, limits: SchedulerLimits, vlog: VllmLog,
                 on_dead: Callable[[Exception], None], seed: int = 0) -> None:
        super().__init__([], limits, vlog, lambda _oom: None, seed=seed)  # see _fail
        self.net = net
        self._on_failure = on_dead
        self._free_list = list(range(limits.num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._filled: dict[str, int] = {}
        self._tokens = random.Random(seed)  # noqa: S311 - prompt ids are given; this fills gaps
        self._sampled: dict[str, int] = {}  # the last token each request sampled

    def _table(self, seq: SchedSeq) -> list[int]:
        """The sequence's block ids, grown to the blocks the scheduler gave it."""
        table = self._tables.setdefault(seq.request_id, [])
        while len(table) < seq.blocks:
            table.append(self._free_list.pop())
        return table

    def _prefill(self, seq: SchedSeq) -> None:
        tokens = [self._tokens.randrange(self.net.d.vocab) for _ in range(seq.prompt_len)]
        (self._sampled[seq.request_id],) = self.net.forward([Seq(tokens, self._table(seq), 0)])
        self._filled[seq.request_id] = len(tokens)

    def _decode(self, seqs: list[SchedSeq]) -> None:
        for k in range(0, len(seqs), DECODE_BATCH):
            part = seqs[k: k + DECODE_BATCH]
            batch = [Seq([self._waiting[s.request_id].output[-1] % self.net.d.vocab],
                         self._table(s), self._filled[s.request_id]) for s in part]
            for s, tok in zip(part, self.net.forward(batch), strict=True):
                self._sampled[s.request_id] = tok
                self._filled[s.request_id] += 1

    def _step(self, plan: StepPlan) -> bool:
        """Run the step on the network; False (the engine now dead) when MindSpore fails."""
        try:
            for chunk in plan.chunks:
                self._prefill(chunk.seq)
            self._decode(plan.decodes)
        except RuntimeError as err:  # MindSpore's allocation failure surfaces here
            self._fail(err)
            return False
        return True

    def token(self, seq: SchedSeq) -> int:
        return self._sampled[seq.request_id]

    def advance(self, plan: StepPlan) -> list[SchedSeq]:
        done = super().advance(plan)
        for seq in done:  # their KV blocks go back to the free list
            self._free_list.extend(self._tables.pop(seq.request_id, []))
            self._filled.pop(seq.request_id, None)
            self._sampled.pop(seq.request_id, None)
        return done

    def _fail(self, err: BaseException) -> None:
        # The HTTP layer only asks whether the engine is dead; the real text is in the log.
        self._fail_all(OutOfMemory(0, 0, "see the MindSpore log", 0), str(err))
        self._on_failure(RuntimeError(str(err).splitlines()[0]))  # what the server prints
