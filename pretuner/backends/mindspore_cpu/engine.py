"""The emulated engine's scheduler over the real network: FCFS prefills, then decode steps.

Scheduling (admission by max-num-seqs, batched tokens and free KV blocks) is the emulated
engine's; each step runs the MindSpore network instead of the memory model. Prefills of one
step run one after the other (their activations do not overlap, as one fused prefill's would);
a decode step runs every running sequence, DECODE_BATCH at a time (one batched forward pays
MindSpore's per-op dispatch once for all of them). A MindSpore allocation failure kills the
engine like vLLM's AsyncEngineDeadError: every request in flight fails, the server exits 1.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from pretuner.backends.mindspore_cpu.network import Seq, TinyLM
from pretuner.sim.engine import Engine, EngineLimits, OutOfMemory, Request
from pretuner.sim.logs import VllmLog

log = logging.getLogger(__name__)

DECODE_BATCH = 16


class MsEngine(Engine):
    """The emulated engine's queues and admission, stepping a real MindSpore network."""

    def __init__(self, net: TinyLM, limits: EngineLimits, vlog: VllmLog,
                 on_dead: Callable[[BaseException], None], seed: int = 0) -> None:
        super().__init__([], limits, vlog, self._dead_noop, seed=seed)
        self.net = net
        self._on_failure = on_dead
        self._free_list = list(range(limits.num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._filled: dict[str, int] = {}
        self._tokens = random.Random(seed)  # noqa: S311 - prompt ids are given; this fills gaps
        self.failure: BaseException | None = None

    @staticmethod
    def _dead_noop(_: object) -> None:
        return

    def _prefill(self, req: Request) -> int:
        need = -(-req.blocks_needed_tokens // self.limits.block_size)
        self._tables[req.request_id] = [self._free_list.pop() for _ in range(need)]
        tokens = [self._tokens.randrange(self.net.d.vocab) for _ in range(req.prompt_len)]
        (tok,) = self.net.forward([Seq(tokens, self._tables[req.request_id], 0)])
        self._filled[req.request_id] = len(tokens)
        return tok

    def _decode(self, reqs: list[Request]) -> list[int]:
        produced: list[int] = []
        for k in range(0, len(reqs), DECODE_BATCH):
            part = reqs[k: k + DECODE_BATCH]
            seqs = [Seq([r.output[-1] % self.net.d.vocab], self._tables[r.request_id],
                        self._filled[r.request_id]) for r in part]
            produced.extend(self.net.forward(seqs))
            for r in part:
                self._filled[r.request_id] += 1
        return produced

    def _release(self, req: Request) -> None:
        self._free_list.extend(self._tables.pop(req.request_id, []))
        self._filled.pop(req.request_id, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    return
                batch = self._admit()
                stepping = batch if batch else list(self._running)
            if not stepping:
                time.sleep(0.01)
                continue
            try:
                if batch:
                    produced = [self._prefill(req) for req in stepping]
                else:
                    produced = self._decode(stepping)
            except RuntimeError as err:  # MindSpore's allocation failure surfaces here
                self._fail(err, batch)
                return
            with self._cond:
                self._running.extend(batch)
                self._prompt_tokens += sum(r.prompt_len for r in batch)
                for req, tok in zip(stepping, produced, strict=True):
                    req.output.append(tok)
                    self._gen_tokens += 1
                    if req.on_token is not None:
                        req.on_token(tok)
                done = [r for r in self._running if len(r.output) >= r.max_tokens]
                for req in done:
                    self._running.remove(req)
                    self._free_blocks += self._blocks(req)
                    self._release(req)
                    req.finished.set()
                self._maybe_metrics()

    def _fail(self, err: BaseException, batch: list[Request]) -> None:
        self.log.error("engine.py:135", f"RuntimeError({str(err).splitlines()[0]!r})")
        with self._cond:
            self.failure = err
            victims = list(self._waiting) + self._running + batch
            self._waiting.clear()
            self._running.clear()
        # The HTTP layer only asks whether the engine is dead; the real text is in the log.
        self.dead = OutOfMemory(0, 0, "see the MindSpore log", 0)
        for req in victims:
            req.error = str(err)
            req.finished.set()
            if req.on_token is not None:
                req.on_token(-1)
        self._on_failure(err)

