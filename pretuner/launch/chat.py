"""Image requests over HTTP: `/v1/chat/completions` with generated PNGs, the text filler that
makes a prompt a given length, and `/reset_mm_cache`.

A chat prompt's length is the server's to count (its template, its tokenizer, its image
tokens): `calibrate` asks it with two short text-only requests (a line fitted to what `usage`
says), and a request refused as too long is shortened by what the refusal names and sent
again. The images are PNGs made here (`pretuner.launch.png`), every one distinct.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pretuner.launch.images import (
    TEMPLATE_TOKENS_GUESS,
    LoadPhase,
    MMRequest,
    Request,
    TextRequest,
)
from pretuner.launch.png import png_data_url
from pretuner.launch.probe import (
    CompletionOutcome,
    complete,
    error_text,
    probe_prompt,
    session_for,
    usage_count,
)

log = logging.getLogger(__name__)

# Four-letter words: one token each in the common BPE vocabularies, about 1.25 by the
# emulator's four-characters-a-token count; the calibration measures which.
FILLER_WORDS = ("time", "year", "work", "life", "hand", "part", "case", "week", "fact", "home",
                "room", "line", "name", "city", "door", "face", "body", "road", "tree", "wind")
CALIBRATION_WORDS = (64, 320)
REFITS = 3  # a too-long request is shortened and sent again at most this many times
_HAS_TOKENS = re.compile(r"request has (\d+) input tokens|\((\d+) in the messages")
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """How many tokens the server counts for the chat template and per filler word."""

    template_tokens: int
    tokens_per_word: float


GUESS = Calibration(TEMPLATE_TOKENS_GUESS, 1.0)


def filler(tokens: int, cal: Calibration, salt: str) -> str:
    """Text the server counts as about `tokens` tokens (never more by the calibration)."""
    words = max(1, math.floor(tokens / cal.tokens_per_word))
    offset = sum(salt.encode()) % len(FILLER_WORDS)
    return " ".join(FILLER_WORDS[(offset + i) % len(FILLER_WORDS)] for i in range(words))


def chat_body(model: str, req: MMRequest, cal: Calibration, salt: str,
              text_tokens: int | None = None) -> dict[str, Any]:
    """One user message: the images, then the text filler."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": png_data_url(a.width_px, a.height_px, a.uid)}}
        for a in req.images]
    tokens = req.text_tokens if text_tokens is None else text_tokens
    parts.append({"type": "text", "text": filler(tokens, cal, salt)})
    return {"model": model, "messages": [{"role": "user", "content": parts}],
            "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True}


def post_chat(base_url: str, body: dict[str, Any], timeout_s: float) -> CompletionOutcome:
    """POST one chat completion; what came back (status 0: no answer)."""
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    started = time.monotonic()
    with session_for(url) as session:
        try:
            response = session.post(url, json=body, timeout=(min(CONNECT_TIMEOUT_S, timeout_s),
                                                             timeout_s))
        except Exception as exc:  # requests' errors and a refused connection alike
            return CompletionOutcome(0, False, time.monotonic() - started, None, None,
                                     f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - started
    if response.status_code != 200:
        return CompletionOutcome(response.status_code, False, seconds, None, None,
                                 error_text(response))
    try:
        reply = response.json()
    except ValueError:
        return CompletionOutcome(200, False, seconds, None, None,
                                 f"not JSON: {response.text[:200]!r}")
    return CompletionOutcome(200, True, seconds, usage_count(reply, "prompt_tokens"),
                             usage_count(reply, "completion_tokens"), None)


def calibrate(base_url: str, model: str, timeout_s: float) -> Calibration | CompletionOutcome:
    """The server's template and filler-word token counts, from two text-only requests; the
    failed outcome when one of them fails."""
    counts = []
    for words in CALIBRATION_WORDS:
        body = chat_body(model, MMRequest((), words, 1), Calibration(0, 1.0), "calibrate")
        out = post_chat(base_url, body, timeout_s)
        if not out.ok or out.prompt_tokens is None:
            return out if not out.ok else CompletionOutcome(
                200, False, out.seconds, None, None, "the server's answer has no usage")
        counts.append(out.prompt_tokens)
    per_word = (counts[1] - counts[0]) / (CALIBRATION_WORDS[1] - CALIBRATION_WORDS[0])
    if per_word <= 0:
        return CompletionOutcome(200, False, 0.0, None, None,
                                 f"the server counted {counts} prompt tokens for "
                                 f"{CALIBRATION_WORDS} words: no text in its prompt?")
    template = max(0, round(counts[0] - per_word * CALIBRATION_WORDS[0]))
    return Calibration(template, per_word)


def send_fitted(base_url: str, model: str, req: MMRequest, cal: Calibration, salt: str,
                max_model_len: int, timeout_s: float) -> CompletionOutcome:
    """One chat request; refused as too long, its text is shortened by what the refusal
    counts and it is sent again. An answer that counts fewer prompt tokens than its images
    take means the server did not see them: a failure."""
    text = req.text_tokens
    out = post_chat(base_url, chat_body(model, req, cal, salt, text), timeout_s)
    for _ in range(REFITS):
        m = _HAS_TOKENS.search(out.error or "") if out.status == 400 else None
        if m is None:
            break
        counted = int(m.group(1) or m.group(2))
        over = counted + req.max_tokens - max_model_len
        text = max(1, text - max(1, over) - 1)
        out = post_chat(base_url, chat_body(model, req, cal, salt, text), timeout_s)
    image_tokens = sum(a.tokens for a in req.images)
    if out.ok and out.prompt_tokens is not None and out.prompt_tokens < image_tokens:
        return CompletionOutcome(200, False, out.seconds, out.prompt_tokens,
                                 out.completion_tokens,
                                 f"the server counted {out.prompt_tokens:,} prompt tokens for "
                                 f"{len(req.images)} image(s) of {image_tokens:,} tokens: "
                                 "it did not read the images")
    return out


def send(base_url: str, model: str, req: Request, cal: Calibration, salt: str,
         max_model_len: int, timeout_s: float) -> CompletionOutcome:
    if isinstance(req, TextRequest):
        return complete(base_url, model, probe_prompt(req.prompt_len, zlib.crc32(salt.encode())),
                        req.max_tokens, timeout_s)
    return send_fitted(base_url, model, req, cal, salt, max_model_len, timeout_s)


def run_phase(base_url: str, model: str, phase: LoadPhase, cal: Calibration,
              max_model_len: int, timeout_s: float, *, deadline: float | None = None,
              on_done: Callable[[int, int], None] | None = None) -> list[CompletionOutcome]:
    """The phase's requests: all at once, or `concurrency` workers each sending the next one
    when its last is answered (a closed loop); no new request starts after `deadline`
    (monotonic seconds). Outcomes in request order, for the requests that were sent."""
    reqs: Sequence[Request] = phase.requests
    results: list[CompletionOutcome | None] = [None] * len(reqs)
    workers = phase.concurrency or len(reqs)
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    barrier = threading.Barrier(max(1, min(workers, len(reqs))))

    def work() -> None:
        if phase.concurrency is None:  # a burst: every request leaves together
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=timeout_s)
        while True:
            with lock:
                i = state["next"]
                if i >= len(reqs) or (deadline is not None and time.monotonic() >= deadline):
                    return
                state["next"] += 1
            results[i] = send(base_url, model, reqs[i], cal, f"{phase.name}/{i}",
                              max_model_len, timeout_s)
            with lock:
                state["done"] += 1
                done = state["done"]
            if on_done is not None:
                on_done(done, len(reqs))
            if phase.concurrency is None:
                return

    threads = [threading.Thread(target=work, name=f"pretuner-{phase.name}-{k}", daemon=True)
               for k in range(max(1, min(workers, len(reqs))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def reset_mm_cache(base_url: str, timeout_s: float = 30.0) -> int:
    """POST /reset_mm_cache; the HTTP status (0: no answer; 404: the route is not served,
    vLLM serves it with VLLM_SERVER_DEV_MODE=1)."""
    url = f"{base_url.rstrip('/')}/reset_mm_cache"
    with session_for(url) as session:
        try:
            return int(session.post(url, timeout=timeout_s).status_code)
        except Exception as exc:  # a server that died: no answer
            log.debug("POST %s failed: %s", url, exc)
            return 0
