"""One streamed `/v1/completions` request, timed by the client: when each token arrived.

Server-sent events (`data: {...}` lines, `data: [DONE]` at the end), with
`stream_options.include_usage` so the last chunk carries the token counts. The arrival time of
the first chunk with text is the time to first token; the span to the last one, over the
tokens after the first (the usage chunk's count), is the decode speed of that one sequence.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import requests

from pretuner.launch.probe import (
    CONNECT_TIMEOUT_S,
    CompletionOutcome,
    error_text,
    session_for,
    usage_count,
)

log = logging.getLogger(__name__)


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


def _token(body: dict[str, Any]) -> bool:
    """A chunk that carries generated output (its text may be empty: a token that ends in the
    middle of a character); the usage chunk has no choices."""
    choices = body.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) for c in choices)


def stream_complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int,
                    timeout_s: float) -> tuple[CompletionOutcome, Arrivals | None]:
    """POST one streamed greedy completion of exactly `max_tokens` tokens; its outcome (as
    `probe.complete` gives it) and when its tokens arrived (None when none did)."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    payload = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    started = time.monotonic()
    first = last = None
    chunks = 0
    usage: dict[str, Any] = {}
    error: str | None = None
    timeout = (min(CONNECT_TIMEOUT_S, timeout_s), timeout_s)  # the read timeout: per chunk
    with session_for(url) as session:
        try:
            response = session.post(url, json=payload, timeout=timeout, stream=True)
            if response.status_code != 200:
                seconds = time.monotonic() - started
                return CompletionOutcome(response.status_code, False, seconds, None, None,
                                         error_text(response)), None
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
                if _token(body):
                    first = now if first is None else first
                    last, chunks = now, chunks + 1
                if isinstance(body.get("usage"), dict):
                    usage = body
        except requests.RequestException as exc:
            seconds = time.monotonic() - started
            log.debug("streamed POST %s failed after %.2f s: %s", url, seconds, exc)
            return CompletionOutcome(0, False, seconds, None, None,
                                     f"{type(exc).__name__}: {exc}"), None
    seconds = time.monotonic() - started
    arrivals = Arrivals(first, last, chunks) if first is not None and last is not None else None
    if error is not None:
        return CompletionOutcome(500, False, seconds, None, None, error), arrivals
    prompt = usage_count(usage, "prompt_tokens")
    completion = usage_count(usage, "completion_tokens")
    return CompletionOutcome(200, True, seconds, prompt,
                             completion if completion is not None else chunks, None), arrivals
