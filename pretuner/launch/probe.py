"""HTTP to an OpenAI-compatible (vLLM API) server: health, models, one completion, a burst."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests

from pretuner.errors import ServerFailedError

log = logging.getLogger(__name__)

# Token ids of probe prompts. Low ids are special/control tokens in most vocabularies and every
# registry model has more than 30,000 entries, so this range is plain text for all of them.
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 30000

CONNECT_TIMEOUT_S = 5.0
_ERROR_TEXT_CHARS = 500


@dataclass(frozen=True, slots=True)
class CompletionOutcome:
    """What one `/v1/completions` request came back with.

    `status` is the HTTP status, or 0 when no answer came (refused, reset, timed out: the
    server may have died mid-request). `error` is the server's message or the client error.
    """

    status: int
    ok: bool
    seconds: float
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """Every outcome of a burst of concurrent completions, in request order."""

    outcomes: tuple[CompletionOutcome, ...]
    wall_seconds: float

    @property
    def all_ok(self) -> bool:
        return bool(self.outcomes) and all(o.ok for o in self.outcomes)

    @property
    def max_seconds(self) -> float:
        return max((o.seconds for o in self.outcomes), default=0.0)


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def session_for(url: str) -> requests.Session:
    session = requests.Session()
    # Ascend hosts often export http_proxy without a no_proxy for localhost; a health check
    # sent through the proxy would never reach the server we just launched.
    session.trust_env = not _is_loopback(url)
    return session


def get_ok(url: str, timeout_s: float) -> bool:
    """True when `GET url` answers 200 within `timeout_s`; any failure is False."""
    with session_for(url) as session:
        try:
            response = session.get(url, timeout=timeout_s)
        except requests.RequestException:
            return False
        return response.status_code == 200


def health(base_url: str, timeout_s: float) -> bool:
    """True when the server's `/health` answers 200."""
    return get_ok(f"{base_url.rstrip('/')}/health", timeout_s)


def served_models(base_url: str, timeout_s: float = 10.0) -> list[str]:
    """The model ids the server lists at `/v1/models`."""
    url = f"{base_url.rstrip('/')}/v1/models"
    with session_for(url) as session:
        try:
            response = session.get(url, timeout=timeout_s)
        except requests.RequestException as exc:
            raise ServerFailedError(f"GET {url} failed: {exc}") from exc
    if response.status_code != 200:
        raise ServerFailedError(
            f"GET {url} answered HTTP {response.status_code}: {error_text(response)}"
        )
    try:
        body = response.json()
        return [str(entry["id"]) for entry in body["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerFailedError(
            f"GET {url} answered an unexpected body: {response.text[:_ERROR_TEXT_CHARS]!r}",
            hint="is this an OpenAI-compatible server?",
        ) from exc


def _token_ids(length: int, seed: int | str) -> list[int]:
    if length < 1:
        raise ValueError(f"prompt length must be at least 1 token, got {length}")
    rng = random.Random(seed)  # noqa: S311 - test data, not cryptography
    return [rng.randint(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(length)]


def probe_prompt(length: int, seed: int) -> list[int]:
    """`length` random token ids, the same for the same seed.

    Give every launch its own seed: a prompt the server has seen could be served from the
    prefix cache and hide the memory the probe is meant to measure.
    """
    return _token_ids(length, f"pretuner-probe/{seed}")


def max_length_prompt_len(max_model_len: int, max_tokens: int) -> int:
    """The longest prompt vLLM accepts with `max_tokens` to generate.

    vLLM 0.6.6 answers HTTP 400 when prompt tokens + max_tokens exceed max_model_len, so a
    max-length probe is `max_model_len - 1` prompt tokens with `max_tokens=1`.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    prompt_len = max_model_len - max_tokens
    if prompt_len < 1:
        raise ValueError(
            f"max_model_len {max_model_len} leaves no room for a prompt with "
            f"max_tokens {max_tokens}"
        )
    return prompt_len


def error_text(response: requests.Response) -> str:
    """The server's own message: vLLM 0.6 `{"message": ...}`, OpenAI `{"error": {...}}`."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str):
            return str(body["message"])
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    text = response.text.strip()
    return text[:_ERROR_TEXT_CHARS] if text else f"HTTP {response.status_code} with no body"


def usage_count(body: Any, key: str) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def complete(
    base_url: str, model: str, prompt_ids: list[int], max_tokens: int, timeout_s: float
) -> CompletionOutcome:
    """POST one greedy completion that must generate exactly `max_tokens` tokens."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    payload = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    # The read timeout bounds the wait for the answer: a non-streaming completion sends
    # nothing until it is done.
    timeout = (min(CONNECT_TIMEOUT_S, timeout_s), timeout_s)
    with session_for(url) as session:
        try:
            response = session.post(url, json=payload, timeout=timeout)
        except requests.RequestException as exc:
            seconds = time.monotonic() - started
            log.debug("POST %s failed after %.2f s: %s", url, seconds, exc)
            return CompletionOutcome(0, False, seconds, None, None, f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - started
    if response.status_code != 200:
        return CompletionOutcome(
            response.status_code, False, seconds, None, None, error_text(response)
        )
    try:
        body = response.json()
    except ValueError:
        text = response.text[:_ERROR_TEXT_CHARS]
        return CompletionOutcome(200, False, seconds, None, None, f"not JSON: {text!r}")
    return CompletionOutcome(
        200,
        True,
        seconds,
        usage_count(body, "prompt_tokens"),
        usage_count(body, "completion_tokens"),
        None,
    )


def load(
    base_url: str,
    model: str,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    timeout_s: float,
    on_done: Callable[[int, int], None] | None = None,
) -> LoadOutcome:
    """Send `num_requests` completions at once, each with its own prompt; wait at most
    about `timeout_s` for all of them. `on_done(done, total)` hears of each answer."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    prompts = [_token_ids(prompt_len, f"pretuner-load/{seed}/{i}") for i in range(num_requests)]
    results: list[CompletionOutcome | None] = [None] * num_requests
    barrier = threading.Barrier(num_requests)
    done = [0]
    done_lock = threading.Lock()

    def one(index: int) -> None:
        # Every thread leaves the barrier together, so the server sees one burst; a broken
        # barrier (a thread that never started) just lets the others go.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=timeout_s)
        results[index] = complete(base_url, model, prompts[index], max_tokens, timeout_s)
        if on_done is not None:
            with done_lock:
                done[0] += 1
                on_done(done[0], num_requests)

    started = time.monotonic()
    threads = [
        threading.Thread(target=one, args=(i,), name=f"pretuner-load-{i}", daemon=True)
        for i in range(num_requests)
    ]
    for thread in threads:
        thread.start()
    # Connect + answer timeouts bound each request; the slack covers thread start-up.
    deadline = started + timeout_s + CONNECT_TIMEOUT_S + 5.0
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    wall = time.monotonic() - started
    outcomes = tuple(
        result
        if result is not None
        else CompletionOutcome(0, False, wall, None, None, f"no answer within {wall:.1f} s")
        for result in results
    )
    failed = sum(1 for o in outcomes if not o.ok)
    log.info("load: %d requests, %d failed, %.2f s", num_requests, failed, wall)
    return LoadOutcome(outcomes, wall)
