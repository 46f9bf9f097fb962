"""Image requests over HTTP: `/v1/chat/completions` with generated PNGs, the text filler that
makes a prompt a given length, and `/reset_mm_cache`. A chat prompt's length is the server's
to count (its template, its tokenizer, its image tokens): `calibrate` asks it.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pretuner.launch.images import LoadPhase, MMRequest, Request, TextRequest
from pretuner.launch.png import png_data_url
from pretuner.launch.probe import (
    CompletionOutcome,
    complete,
    post,
    probe_prompt,
    send_all,
)

# Four-letter words: one token each in the common BPE vocabularies, about 1.25 by the
# emulator's four-characters-a-token count; the calibration measures which.
FILLER_WORDS = ("time", "year", "work", "life", "hand", "part", "case", "week", "fact", "home",
                "room", "line", "name", "city", "door", "face", "body", "road", "tree", "wind")
CALIBRATION_WORDS = (64, 320)
REFITS = 3  # a too-long request is shortened and sent again at most this many times
_HAS_TOKENS = re.compile(r"request has (\d+) input tokens|\((\d+) in the messages")


@dataclass(frozen=True, slots=True)
class Calibration:
    """How many tokens the server counts for the chat template and per filler word."""

    template_tokens: int
    tokens_per_word: float


def filler(tokens: int, cal: Calibration, salt: str) -> str:
    """Text the server counts as about `tokens` tokens (never more by the calibration)."""
    words = max(1, math.floor(tokens / cal.tokens_per_word))
    offset = sum(salt.encode()) % len(FILLER_WORDS)
    return " ".join(FILLER_WORDS[(offset + i) % len(FILLER_WORDS)] for i in range(words))


def post_chat(base_url: str, model: str, req: MMRequest, cal: Calibration, salt: str,
              text_tokens: int, timeout_s: float) -> CompletionOutcome:
    """One user message, the images then `text_tokens` of text filler; what came back."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": png_data_url(a.width_px, a.height_px, a.uid)}}
        for a in req.images]
    parts.append({"type": "text", "text": filler(text_tokens, cal, salt)})
    body = {"model": model, "messages": [{"role": "user", "content": parts}],
            "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True}
    return post(f"{base_url.rstrip('/')}/v1/chat/completions", body, timeout_s)


def calibrate(base_url: str, model: str, timeout_s: float) -> Calibration | CompletionOutcome:
    """The server's template and filler-word token counts, or the outcome that failed."""
    counts = []
    for words in CALIBRATION_WORDS:
        out = post_chat(base_url, model, MMRequest((), words, 1), Calibration(0, 1.0),
                        "calibrate", words, timeout_s)
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
    """One chat request, its text shortened and sent again while refused as too long; an
    answer that counts fewer prompt tokens than its images take is a failure."""
    text = req.text_tokens
    out = post_chat(base_url, model, req, cal, salt, text, timeout_s)
    for _ in range(REFITS):
        m = _HAS_TOKENS.search(out.error or "") if out.status == 400 else None
        if m is None:
            break
        counted = int(m.group(1) or m.group(2))
        over = counted + req.max_tokens - max_model_len
        text = max(1, text - max(1, over) - 1)
        out = post_chat(base_url, model, req, cal, salt, text, timeout_s)
    image_tokens = sum(a.tokens for a in req.images)
    if out.ok and out.prompt_tokens is not None and out.prompt_tokens < image_tokens:
        return CompletionOutcome(200, False, out.seconds, out.prompt_tokens,
                                 out.completion_tokens,
                                 f"the server counted {out.prompt_tokens:,} prompt tokens for "
                                 f"{len(req.images)} image(s) of {image_tokens:,} tokens: "
                                 "it did not read the images")
    return out


def send(base_url: str, model: str, req: Request, cal: Calibration, salt: str,
         max_model_len: int, timeout_s: float, vocab_size: int | None) -> CompletionOutcome:
    if isinstance(req, TextRequest):
        prompt = probe_prompt(req.prompt_len, zlib.crc32(salt.encode()), vocab_size)
        return complete(base_url, model, prompt, req.max_tokens, timeout_s)
    return send_fitted(base_url, model, req, cal, salt, max_model_len, timeout_s)


def run_phase(base_url: str, model: str, phase: LoadPhase, cal: Calibration,
              max_model_len: int, timeout_s: float, *, vocab_size: int | None = None,
              deadline: float | None = None,
              on_done: Callable[[int, int], None] | None = None) -> list[CompletionOutcome]:
    """The phase's requests (`probe.send_all`); the outcomes of those sent, in order."""
    calls = [functools.partial(send, base_url, model, req, cal, f"{phase.name}/{i}",
                               max_model_len, timeout_s, vocab_size)
             for i, req in enumerate(phase.requests)]
    return [r for r in send_all(calls, timeout_s, name=phase.name, workers=phase.concurrency,
                                deadline=deadline, on_done=on_done) if r is not None]


def reset_mm_cache(base_url: str, timeout_s: float = 30.0) -> int:
    """POST /reset_mm_cache; the HTTP status (0: no answer; 404: the route is not served,
    vLLM serves it with VLLM_SERVER_DEV_MODE=1)."""
    return post(f"{base_url.rstrip('/')}/reset_mm_cache", None, timeout_s).status
