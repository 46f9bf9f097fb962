"""vLLM 0.24's OpenAI API on the shared front (`pretuner.sim.http`): completions (streamed with
an optional usage chunk), chat with images (`pretuner.sim.v1.chat`), `/reset_mm_cache` with
`VLLM_SERVER_DEV_MODE=1`; /health 503 and the real 500 body once the engine died."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pretuner.sim import http as front
from pretuner.sim.http import detokenize, prompt_length, usage
from pretuner.sim.loop import EngineDead
from pretuner.sim.v1 import logs as L
from pretuner.sim.v1.chat import ChatError, chat_max_tokens, parse_chat
from pretuner.sim.v1.engine import Engine, Pending
from pretuner.sim.v1.mm import MMItem, VisionCard
from pretuner.sim.v1.scheduler import Req


@dataclass(frozen=True, slots=True)
class ApiConfig(front.ApiConfig):
    vision: VisionCard | None = None
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: the development routes exist


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


DEAD_BODY = error_body(L.ENGINE_DEAD, "InternalServerError", 500)


def length_error(max_model_len: int, prompt_len: int, max_tokens: int) -> str | None:
    """vLLM's 400 text for a request that does not fit in max_model_len; None when it fits."""
    if prompt_len >= max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the input "
                "messages.")
    if prompt_len + max_tokens > max_model_len:
        return (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {max_model_len} tokens and your request "
                f"has {prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len}).")
    return None


class V1HTTPServer(front.FrontServer):
    api: ApiConfig

    def __init__(self, addr: tuple[str, int], engine: Engine, api: ApiConfig,
                 log: L.V1Log) -> None:
        super().__init__(addr, _Handler, api, log)
        self.engine = engine


class _Handler(front.Handler):
    server: V1HTTPServer
    separators = (",", ":")
    posts = ("/v1/completions", "/v1/chat/completions")
    not_object = "the body is not a JSON object"

    def error_body(self, message: str, kind: str, code: int) -> dict[str, Any]:
        return error_body(message, kind, code)

    def health(self) -> None:
        self._send(503 if self.server.engine.dead else 200, b"")

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        if self.path == "/reset_mm_cache" and self.server.api.dev_mode:
            self.server.engine.reset_mm_cache()
            self._send(200, b"")
            return
        super().do_POST()

    def post(self, body: dict[str, Any]) -> None:
        model = self._model(body)
        if model is None:
            return
        if self.path == "/v1/chat/completions":
            self._chat(body, model)
        else:
            self._complete(body, model)

    def _complete(self, body: dict[str, Any], model: str) -> None:
        prompt_len = prompt_length(body.get("prompt", ""))
        raw_max = body.get("max_tokens")
        max_tokens = 16 if raw_max is None else raw_max
        if prompt_len is None or not isinstance(max_tokens, int) or max_tokens < 1:
            self._error(400, "prompt must be a string or a list of token ids and max_tokens a "
                        "positive integer")
            return
        rid = f"cmpl-{uuid.uuid4().hex[:16]}-0"
        pending = self._submit(rid, prompt_len, max_tokens, ())
        if pending is None:
            return
        if body.get("stream") is True:
            options = body.get("stream_options")
            with_usage = isinstance(options, dict) and options.get("include_usage") is True
            self._stream(pending, model, with_usage)
            return
        generated = self._wait(pending)
        if generated is not None:
            self._json(200, front.completion(rid, model, detokenize(list(range(generated))),
                                             prompt_len, generated))

    def _chat(self, body: dict[str, Any], model: str) -> None:
        api = self.server.api
        try:
            prompt = parse_chat(body, api.vision)
        except ChatError as err:
            self._error(400, str(err))
            return
        max_tokens = chat_max_tokens(body, api.max_model_len, prompt.prompt_len)
        if max_tokens is None:
            self._error(400, "max_tokens must be a positive integer")
            return
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        pending = self._submit(rid, prompt.prompt_len, max_tokens, prompt.images)
        generated = None if pending is None else self._wait(pending)
        if generated is None:
            return
        self._json(200, {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content":
                                                 detokenize(list(range(generated)))},
                         "logprobs": None, "finish_reason": "length", "stop_reason": None}],
            "usage": usage(prompt.prompt_len, generated),
        })

    def _submit(self, rid: str, prompt_len: int, max_tokens: int,
                images: tuple[MMItem, ...]) -> Pending | None:
        """Length check, then the engine's queue; None once an error was answered."""
        too_long = length_error(self.server.api.max_model_len, prompt_len, max_tokens)
        if too_long is not None:
            self._error(400, too_long)
            return None
        try:
            return self.server.engine.submit(Req(rid, prompt_len, max_tokens, mm=images))
        except EngineDead:
            self._json(500, DEAD_BODY)
            return None

    def _wait(self, pending: Pending) -> int | None:
        """The tokens the request generated; None once the engine's death was answered."""
        pending.done.wait()
        if pending.error is not None:
            self._json(500, DEAD_BODY)
            return None
        return pending.req.generated

    def _stream(self, pending: Pending, model: str, with_usage: bool) -> None:
        """Server-sent events, one per token; the headers go once the first token (or the
        engine's death) is known, so a request the engine never ran gets the plain 500."""
        first = _next_token(pending)
        if first is None:
            self._json(500, DEAD_BODY)
            return
        self._open_stream()
        req, created = pending.req, int(time.time())
        head = {"id": req.request_id, "object": "text_completion", "created": created,
                "model": model}
        count: int | None = first
        while count is not None:
            last = count >= req.max_tokens
            self._event(front.stream_choice(head, detokenize([count - 1]),
                                            "length" if last else None))
            count = None if last else _next_token(pending)
        if pending.error is not None:
            self._event(DEAD_BODY)
        elif with_usage:
            self._event({**head, "choices": [], "usage": {
                "prompt_tokens": req.prompt_len, "completion_tokens": req.generated,
                "total_tokens": req.prompt_len + req.generated}})
        self._close_stream()


def _next_token(pending: Pending) -> int | None:
    """The count of tokens generated once the next one is; None when the engine died."""
    count = pending.tokens.get()
    return None if count < 0 else count

