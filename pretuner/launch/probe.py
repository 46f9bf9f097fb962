"""HTTP to an OpenAI-compatible (vLLM API) server: health, models, one completion (streamed or
not), a burst or a closed loop of them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import ipaddress
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool

from pretuner.errors import ServerFailedError

log = logging.getLogger(__name__)

# Token ids of probe prompts: plain text in every registry model's vocabulary. Vocabularies keep
# their special and control tokens at the low ids, and padding (or more specials) at the top, so a
# smaller vocabulary gets its middle: an id beyond it is vLLM's "Token id N is out of vocabulary".
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 30000

CONNECT_TIMEOUT_S = 5.0
_ERROR_TEXT_CHARS = 500
# API keys by server address (`host:port`): a server started with one answers pretuner's own
# requests only when they carry it (`bearer`).
_BEARERS: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class CompletionOutcome:
    """What one completion request came back with."""

    status: int  # HTTP, or 0: no answer (refused, reset, timed out: the server may have died)
    ok: bool
    seconds: float
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None  # the server's message or the client error


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """Every outcome of a burst of concurrent completions, in request order."""

    outcomes: tuple[CompletionOutcome, ...]
    wall_seconds: float

    @property
    def all_ok(self) -> bool:
        return bool(self.outcomes) and all(o.ok for o in self.outcomes)


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(eq=False, slots=True)
class _Scope:
    """The requests sent to one launched server (`bearer`): ended, none stays open."""

    ended: bool = False
    open: set[HTTPConnection] = field(default_factory=set)


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("pretuner_requests",
                                                                      default=None)
_scope_lock = threading.Lock()


class _ScopedConnection(HTTPConnection):
    """A connection that its scope's end cuts from another thread: on Ctrl-C during a load a
    server stopped while pretuner's requests are open waits for them ("Waiting for connections
    to close") through the whole stop grace."""

    _scope: _Scope | None = None

    def connect(self) -> None:
        scope = self._scope = _SCOPE.get()
        if scope is not None:
            with _scope_lock:
                if scope.ended:
                    raise ConnectionAbortedError("pretuner stopped its requests to this server")
                scope.open.add(self)
        super().connect()
        if scope is not None and scope.ended:  # cut while it connected
            self.close()
            raise ConnectionAbortedError("pretuner stopped its requests to this server")

    def close(self) -> None:
        if self._scope is not None:
            with _scope_lock:
                self._scope.open.discard(self)
        super().close()


class _ScopedPool(HTTPConnectionPool):
    ConnectionCls = _ScopedConnection


def session_for(url: str) -> requests.Session:
    session = requests.Session()
    manager = cast(HTTPAdapter, session.get_adapter("http://")).poolmanager
    manager.pool_classes_by_scheme = {**manager.pool_classes_by_scheme, "http": _ScopedPool}
    # Ascend hosts often export http_proxy without a no_proxy for localhost; a health check
    # sent through the proxy would never reach the server we just launched.
    session.trust_env = not _is_loopback(url)
    if (key := _BEARERS.get(urlsplit(url).netloc)) is not None:
        session.headers["Authorization"] = f"Bearer {key}"
    return session


@contextlib.contextmanager
def bearer(base_url: str, key: str | None) -> Iterator[None]:
    """Every request to the server at `base_url` sends `key` as its bearer token (if any); at
    the end (Ctrl-C included) the requests sent from within, in any thread, that are still open
    are cut and no new one connects, so that the server can stop at once."""
    address = urlsplit(base_url).netloc
    if key:
        _BEARERS[address] = key
    scope = _Scope()
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        _BEARERS.pop(address, None)
        with _scope_lock:
            scope.ended = True
            cut, scope.open = list(scope.open), set()
        for connection in cut:
            with contextlib.suppress(OSError, AttributeError):
                connection.sock.shutdown(socket.SHUT_RDWR)  # the reader thread wakes at once


def get_ok(url: str, timeout_s: float) -> bool:
    """True when `GET url` answers 200 within `timeout_s`; any failure is False."""
    with session_for(url) as session:
        try:
            response = session.get(url, timeout=timeout_s)
        except requests.RequestException:
            return False
        return response.status_code == 200


def served_models(base_url: str, timeout_s: float = 10.0) -> list[str]:
    """The model ids the server lists at `/v1/models`."""
    url = f"{base_url.rstrip('/')}/v1/models"
    with session_for(url) as session:
        try:
            response = session.get(url, timeout=timeout_s)
        except requests.RequestException as exc:
            raise ServerFailedError(f"GET {url} failed: {exc}") from exc
    if response.status_code != 200:
        raise ServerFailedError(f"GET {url} answered HTTP {response.status_code}: "
                                f"{error_text(response)}")
    try:
        body = response.json()
        return [str(entry["id"]) for entry in body["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerFailedError(
            f"GET {url} answered an unexpected body: {response.text[:_ERROR_TEXT_CHARS]!r}",
            hint="is this an OpenAI-compatible server?",
        ) from exc


def token_range(vocab_size: int | None) -> tuple[int, int]:
    """The lowest and highest token id of probe prompts for a vocabulary of `vocab_size` ids
    (None: not known, the range every registry model holds)."""
    if vocab_size is None:
        return TOKEN_ID_LOW, TOKEN_ID_HIGH
    margin = vocab_size // 8
    return min(TOKEN_ID_LOW, margin), min(TOKEN_ID_HIGH, vocab_size - 1 - margin)


def _token_ids(length: int, seed: int | str, vocab_size: int | None) -> list[int]:
    if length < 1:
        raise ValueError(f"prompt length must be at least 1 token, got {length}")
    rng = random.Random(seed)  # noqa: S311 - test data, not cryptography
    low, high = token_range(vocab_size)
    return [rng.randint(low, high) for _ in range(length)]


def probe_prompt(length: int, seed: int, vocab_size: int | None = None) -> list[int]:
    """`length` random token ids of the vocabulary, the same for the same seed."""
    # Give every launch its own seed: a prompt the server has seen could be served from the
    # prefix cache and hide the memory the probe is meant to measure.
    return _token_ids(length, f"pretuner-probe/{seed}", vocab_size)


def max_length_prompt_len(max_model_len: int, max_tokens: int) -> int:
    """The longest prompt vLLM accepts with `max_tokens` to generate (vLLM answers HTTP 400
    when prompt tokens + max_tokens exceed max_model_len)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    prompt_len = max_model_len - max_tokens
    if prompt_len < 1:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a prompt with "
                         f"max_tokens {max_tokens}")
    return prompt_len


def error_text(response: requests.Response) -> str:
    """The server's own message: vLLM 0.6 `{"message": ...}`, OpenAI `{"error": {...}}`."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        nested = error.get("message") if isinstance(error, dict) else error
        for text in (nested, body.get("message"), body.get("detail")):
            if isinstance(text, str):
                return text
    text = response.text.strip()
    return text[:_ERROR_TEXT_CHARS] if text else f"HTTP {response.status_code} with no body"


def usage_count(body: Any, key: str) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def post(url: str, body: dict[str, Any] | None, timeout_s: float,
         read: Callable[[requests.Response, float], CompletionOutcome] | None = None,
         ) -> CompletionOutcome:
    """POST one completion request (`/v1/completions`, `/v1/chat/completions`); what came back.
    `read(response, started)` takes a streamed 200 answer apart; else it is one JSON body."""
    started = time.monotonic()
    # The read timeout bounds the wait for the answer (a non-streaming completion sends
    # nothing until it is done), or for each chunk of a streamed one.
    timeout = (min(CONNECT_TIMEOUT_S, timeout_s), timeout_s)
    with session_for(url) as session:
        try:
            response = session.post(url, json=body, timeout=timeout, stream=read is not None)
            if response.status_code != 200:
                return CompletionOutcome(response.status_code, False, time.monotonic() - started,
                                         None, None, error_text(response))
            if read is not None:
                return read(response, started)
        except requests.RequestException as exc:
            seconds = time.monotonic() - started
            log.debug("POST %s failed after %.2f s: %s", url, seconds, exc)
            return CompletionOutcome(0, False, seconds, None, None, f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - started
    try:
        reply = response.json()
    except ValueError:
        text = response.text[:_ERROR_TEXT_CHARS]
        return CompletionOutcome(200, False, seconds, None, None, f"not JSON: {text!r}")
    return CompletionOutcome(200, True, seconds, usage_count(reply, "prompt_tokens"),
                             usage_count(reply, "completion_tokens"), None)


def _completion(model: str, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int,
             timeout_s: float) -> CompletionOutcome:
    """POST one greedy completion that must generate exactly `max_tokens` tokens."""
    body = _completion(model, prompt_ids, max_tokens)
    return post(f"{base_url.rstrip('/')}/v1/completions", body, timeout_s)


def load(base_url: str, model: str, num_requests: int, prompt_len: int, max_tokens: int,
         seed: int, timeout_s: float, vocab_size: int | None = None,
         on_done: Callable[[int, int], None] | None = None) -> LoadOutcome:
    """`num_requests` completions at once, each with its own prompt, waited for about
    `timeout_s`; `on_done(done, total)` hears of each answer."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    prompts = [_token_ids(prompt_len, f"pretuner-load/{seed}/{i}", vocab_size)
               for i in range(num_requests)]
    calls = [functools.partial(complete, base_url, model, p, max_tokens, timeout_s)
             for p in prompts]
    started = time.monotonic()
    # Connect + answer timeouts bound each request; the slack covers thread start-up.
    wait_s = timeout_s + CONNECT_TIMEOUT_S + 5.0
    results = send_all(calls, timeout_s, name="load", wait_s=wait_s, on_done=on_done)
    wall = time.monotonic() - started
    missing = CompletionOutcome(0, False, wall, None, None, f"no answer within {wall:.1f} s")
    outcomes = tuple(missing if r is None else r for r in results)
    failed = sum(1 for o in outcomes if not o.ok)
    log.info("load: %d requests, %d failed, %.2f s", num_requests, failed, wall)
    return LoadOutcome(outcomes, wall)


def send_all(calls: Sequence[Callable[[], CompletionOutcome]], timeout_s: float, *, name: str,
             workers: int | None = None, deadline: float | None = None,
             wait_s: float | None = None,
             on_done: Callable[[int, int], None] | None = None) -> list[CompletionOutcome | None]:
    """Run `calls` all at once (a burst), or `workers` at a time, each sending the next when its
    last is answered (a closed loop); none starts after `deadline` (monotonic seconds). Outcomes
    in call order: None for a call not sent, or not answered within `wait_s`."""
    results: list[CompletionOutcome | None] = [None] * len(calls)
    threads = max(1, min(workers or len(calls), len(calls)))
    barrier = threading.Barrier(threads)
    lock = threading.Lock()
    state = {"next": 0, "done": 0}

    def work() -> None:
        if workers is None:
            # Every thread leaves the barrier together, so the server sees one burst; a broken
            # barrier (a thread that never started) just lets the others go.
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=timeout_s)
        while True:
            with lock:
                i = state["next"]
                if i >= len(calls) or (deadline is not None and time.monotonic() >= deadline):
                    return
                state["next"] += 1
            results[i] = calls[i]()
            with lock:
                state["done"] += 1
                if on_done is not None:
                    on_done(state["done"], len(calls))
            if workers is None:
                return

    join_by = None if wait_s is None else time.monotonic() + wait_s
    # Each thread in a copy of the caller's context: its requests belong to the caller's scope.
    running = [threading.Thread(target=contextvars.copy_context().run, args=(work,),
                                name=f"pretuner-{name}-{k}", daemon=True)
               for k in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(timeout=None if join_by is None else max(0.0, join_by - time.monotonic()))
    return results


# One streamed `/v1/completions` request, timed by the client: server-sent events (`data: {...}`
# lines, `data: [DONE]` at the end), with `stream_options.include_usage` so the last chunk
# carries the token counts. The arrival of the first chunk with text is the time to first
# token; the span to the last one, over the tokens after the first, is the decode speed of
# that one sequence.


@dataclass(frozen=True, slots=True)
class Arrivals:
    """When the streamed tokens came, seconds after the request was sent."""

    first_s: float
    last_s: float
    chunks: int


def _chunk(line: bytes) -> dict[str, Any] | str | None:
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:"):].strip()
    if data == "[DONE]":
        return data
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def stream_complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int,
                    timeout_s: float) -> tuple[CompletionOutcome, Arrivals | None]:
    """POST one streamed greedy completion of exactly `max_tokens` tokens; its outcome (as
    `probe.complete` gives it) and when its tokens arrived (None when none did)."""
    arrived: list[Arrivals] = []

    def read(response: requests.Response, started: float) -> CompletionOutcome:
        first = last = None
        chunks = 0
        usage: dict[str, Any] = {}
        error: str | None = None
        for line in response.iter_lines():
            body = _chunk(line)
            if body == "[DONE]":
                break
            if not isinstance(body, dict):
                continue
            now = time.monotonic() - started
            if isinstance(body.get("error"), dict):
                error = str(body["error"].get("message") or body["error"])
                break
            # A chunk with choices carries a token (its text may be empty: a token that ends
            # in the middle of a character); the usage chunk has none.
            choices = body.get("choices")
            if isinstance(choices, list) and any(isinstance(c, dict) for c in choices):
                first = now if first is None else first
                last, chunks = now, chunks + 1
            if isinstance(body.get("usage"), dict):
                usage = body
        seconds = time.monotonic() - started
        if first is not None and last is not None:
            arrived.append(Arrivals(first, last, chunks))
        if error is not None:
            return CompletionOutcome(500, False, seconds, None, None, error)
        completion = usage_count(usage, "completion_tokens")
        return CompletionOutcome(200, True, seconds, usage_count(usage, "prompt_tokens"),
                                 completion if completion is not None else chunks, None)

    payload = {**_completion(model, prompt_ids, max_tokens), "stream": True,
               "stream_options": {"include_usage": True}}
    out = post(f"{base_url.rstrip('/')}/v1/completions", payload, timeout_s, read)
    return out, arrived[0] if arrived else None
