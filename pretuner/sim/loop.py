"""The engine loop both personalities share: sequences, the scheduler's queues and KV blocks,
the engine thread and its throughput line; the step rules and memory stay with each."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# eq=False: a request is itself, not its fields' values; `in running` and `remove` compare
# identities at C speed (field-wise equality made a 1024-wide burst's steps quadratic).
@dataclass(eq=False)
class SeqBase:
    """One request as a scheduler tracks it."""

    request_id: str
    prompt_len: int
    max_tokens: int
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    blocks: int = 0

    @property
    def done(self) -> bool:
        return self.generated >= self.max_tokens


S = TypeVar("S", bound=SeqBase)


class SchedulerBase(Generic[S]):
    """FCFS queues over a fixed number of KV blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.waiting: deque[S] = deque()
        self.running: list[S] = []

    def add(self, seq: S) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks


class Throughput:
    """Tokens since the last periodic metrics line, and whether the next one is due."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.since = time.monotonic()
        self.prompt_tokens = 0
        self.generated = 0

    def due(self) -> tuple[float, float] | None:
        """(prompt, generation) tokens/s once `every_s` passed (then counting anew)."""
        now = time.monotonic()
        span = now - self.since
        if span < self.every_s:
            return None
        rates = self.prompt_tokens / span, self.generated / span
        self.since, self.prompt_tokens, self.generated = now, 0, 0
        return rates


class EngineDead(RuntimeError):
    """A request submitted to an engine that died (vLLM's AsyncEngineDeadError)."""


@dataclass(eq=False, kw_only=True)
class Waiter:
    """What an HTTP handler waits on: `done` once answered (`error` when the engine died under
    it); `tokens` gets each token as it is sampled, then a negative one if it failed."""

    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    tokens: queue.SimpleQueue[int] = field(default_factory=queue.SimpleQueue)

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()
        self.tokens.put(-1)


W = TypeVar("W", bound=Waiter)


class EngineThread(Generic[W]):
    """An engine stepping on its own thread while HTTP handlers submit and wait."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._waiting: dict[str, W] = {}  # by request id

    def _fail_waiting(self, error: str) -> None:
        """Every request in flight fails with `error` (the engine died)."""
        with self._cond:
            waiting, self._waiting = self._waiting, {}
        for w in waiting.values():
            w.fail(error)

    def _loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
