"""The emulated r0.1 engine's scheduling (`pretuner.sim.scheduler`) over a real MindSpore network.

Prefills of one step run one after the other, decodes DECODE_BATCH at a time (one batched
forward pays MindSpore's per-op dispatch once). A MindSpore allocation failure kills the
engine like vLLM's AsyncEngineDeadError."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from pretuner.sim.engine import Engine, OutOfMemory
from pretuner.sim.logs import VllmLog
from pretuner.sim.mindspore_cpu.network import Seq, TinyLM
from pretuner.sim.scheduler import SchedulerLimits
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

    def _table(self, seq: SchedSeq) -> list[int]:
        """The sequence's block ids, grown to the blocks the scheduler gave it."""
        table = self._tables.setdefault(seq.request_id, [])
        while len(table) < seq.blocks:
            table.append(self._free_list.pop())
        return table

    def _prefill(self, seq: SchedSeq) -> int:
        tokens = [self._tokens.randrange(self.net.d.vocab) for _ in range(seq.prompt_len)]
        (tok,) = self.net.forward([Seq(tokens, self._table(seq), 0)])
        self._filled[seq.request_id] = len(tokens)
        return tok

    def _decode(self, seqs: list[SchedSeq]) -> list[int]:
        produced: list[int] = []
        for k in range(0, len(seqs), DECODE_BATCH):
            part = seqs[k: k + DECODE_BATCH]
            batch = [Seq([self._requests[s.request_id].output[-1] % self.net.d.vocab],
                         self._table(s), self._filled[s.request_id]) for s in part]
            produced.extend(self.net.forward(batch))
            for s in part:
                self._filled[s.request_id] += 1
        return produced

    def _release(self, request_id: str) -> None:
        self._free_list.extend(self._tables.pop(request_id, []))
        self._filled.pop(request_id, None)

    def _loop(self) -> None:
        while (plan := self._next_plan()) is not None:
            if plan.empty:
                time.sleep(0.01)
                continue
            try:
                if plan.chunks:
                    produced = [self._prefill(c.seq) for c in plan.chunks]
                    stepping = [c.seq for c in plan.chunks]
                else:
                    produced = self._decode(plan.decodes)
                    stepping = plan.decodes
            except RuntimeError as err:  # MindSpore's allocation failure surfaces here
                self._fail(err)
                return
            with self._cond:
                self.tally.prompt_tokens += plan.prefill_tokens
                done = self.sched.commit(plan)
                for seq, tok in zip(stepping, produced, strict=True):
                    req = self._requests[seq.request_id]
                    req.output.append(tok)
                    self.tally.generated += 1
                    if req.on_token is not None:
                        req.on_token(tok)
                for seq in done:
                    self._release(seq.request_id)
                    self._requests.pop(seq.request_id).finished.set()
                self._maybe_metrics()

    def _fail(self, err: BaseException) -> None:
        # The HTTP layer only asks whether the engine is dead; the real text is in the log.
        self._fail_all(OutOfMemory(0, 0, "see the MindSpore log", 0), str(err))
        self._on_failure(RuntimeError(str(err).splitlines()[0]))  # what the server prints
