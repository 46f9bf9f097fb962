"""The r0.1 personality's answers on the shared HTTP front (`pretuner.sim.http`), as vLLM
0.6.6 gives them: `{"object": "error", ...}` bodies, a prompt that leaves no room for
`max_tokens` within max_model_len gets vLLM's 400, a request caught by an engine crash a bare
500 (FastAPI's answer to an unhandled exception), and `stream` sends chunked events."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from pretuner.sim.engine import Engine, Request
from pretuner.sim.http import (
    ApiConfig,
    FrontServer,
    Handler,
    completion,
    detokenize,
    prompt_length,
    stream_choice,
)
from pretuner.sim.logs import VllmLog
from pretuner.sim.loop import EngineDead

_PLAIN = "text/plain; charset=utf-8"


class SimHTTPServer(FrontServer):
    log: VllmLog

    def __init__(self, addr: tuple[str, int], engine: Engine, api: ApiConfig, log: VllmLog,
                 health: Callable[[], str | None]) -> None:
        super().__init__(addr, _Handler, api, log)
        self.engine = engine
        self.health = health  # a failing rank elsewhere (a dead Ray worker): vLLM asks them all


class _Handler(Handler):
    server: SimHTTPServer
    chunked = True

    def error_body(self, message: str, kind: str, code: int) -> dict[str, Any]:
        return {"object": "error", "message": message, "type": kind, "param": None,
                "code": code}

    def health(self) -> None:
        if self.server.engine.dead is not None or self.server.health():
            self._send(500, b"Internal Server Error", _PLAIN)
        else:
            self._send(200, b"")

    def post(self, body: dict[str, Any]) -> None:
        model = self._model(body)
        if model is None:
            return
        raw = body.get("prompt", "")
        prompt_len = prompt_length(raw if isinstance(raw, list) else str(raw))
        if prompt_len is None:
            self._error(400, "prompt must be a string or a list of token ids")
            return
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else int(max_tokens)
        mml = self.server.api.max_model_len
        if prompt_len + max_tokens > mml:
            self._error(400, f"This model's maximum context length is {mml} tokens. However, "
                        f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                        f"messages, {max_tokens} in the completion). Please reduce the length "
                        "of the messages or completion.")
            return
        rid = f"cmpl-{uuid.uuid4().hex}"
        log = self.server.log
        log.info("logger.py:37", f"Received request {rid}-0: prompt: None, params: "
                 f"SamplingParams(n=1, max_tokens={max_tokens}), prompt_token_ids: "
                 f"[{prompt_len} tokens], lora_request: None, prompt_adapter_request: None.")
        req = Request(rid, prompt_len, max_tokens)
        try:
            self.server.engine.submit(req)
        except EngineDead:
            self._send(500, b"Internal Server Error", _PLAIN)
            return
        log.info("engine.py:267", f"Added request {rid}-0.")
        if body.get("stream", False):
            self._stream(req, model)
            return
        req.done.wait()
        # A prompt the scheduler ignored is answered 200 with no output, as vLLM does.
        if req.error is not None:
            self._send(500, b"Internal Server Error", _PLAIN)
            return
        self._json(200, completion(rid, model, detokenize(req.output), prompt_len,
                                   len(req.output)))

    def _stream(self, req: Request, model: str) -> None:
        self._open_stream()
        head = {"id": req.request_id, "object": "text_completion", "created": int(time.time()),
                "model": model}
        sent = 0
        while sent < req.max_tokens:
            tok = req.tokens.get()
            if tok == -2:  # ignored by the scheduler: an empty, finished choice
                self._event(stream_choice(head, "", "length"))
                break
            if tok < 0:
                self._event(self.error_body("Internal Server Error", "InternalServerError", 500))
                break
            sent += 1
            self._event(stream_choice(head, detokenize([tok]),
                                      "length" if sent == req.max_tokens else None))
        self._close_stream()
