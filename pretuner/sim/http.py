"""The OpenAI-compatible HTTP API of the emulated server, on the standard library only.

Routes and error bodies follow vLLM 0.6.6: `GET /health`, `GET /v1/models`,
`POST /v1/completions` (prompt as text or token ids, `max_tokens` default 16, `stream`).
A prompt that leaves no room for `max_tokens` within max_model_len gets vLLM's 400; a request
caught by an engine crash gets a bare 500, as FastAPI answers an unhandled exception.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pretuner.sim.engine import Engine, EngineDeadError, Request
from pretuner.sim.logs import VllmLog

_WORDS = ("the", "card", "memory", "pool", "token", "block", "cache", "model", "ascend", "peak")


@dataclass(frozen=True, slots=True)
class ApiConfig:
    served_names: tuple[str, ...]
    model_root: str
    max_model_len: int


def count_tokens(text: str) -> int:
    """The emulator's tokenizer: about one token per four characters, at least one."""
    return max(1, -(-len(text) // 4))


def detokenize(tokens: list[int]) -> str:
    return "".join(" " + _WORDS[t % len(_WORDS)] for t in tokens)


def context_error(max_model_len: int, prompt_len: int, max_tokens: int) -> str:
    return (f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.")


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # uvicorn's listen backlog; the standard library's 5 resets connections when a full load
    # of max-num-seqs clients connects at once, which the real server never does.
    request_queue_size = 2048

    def __init__(self, addr: tuple[str, int], engine: Engine, api: ApiConfig, log: VllmLog,
                 on_request_done: Callable[[], None] | None = None) -> None:
        super().__init__(addr, _Handler)
        self.engine = engine
        self.api = api
        self.log = log
        self.on_request_done = on_request_done
        # A failing rank elsewhere (a dead Ray worker): vLLM's /health asks every worker.
        self.health: Callable[[], str | None] | None = None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SimHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        return  # uvicorn-style access lines are written by _access()

    def _access(self, code: int) -> None:
        phrase = {200: "OK", 400: "Bad Request", 404: "Not Found",
                  500: "Internal Server Error"}.get(code, "")
        host, port = self.client_address[:2]
        self.server.log.uvicorn(f'{host}:{port} - "{self.command} {self.path} HTTP/1.1" '
                                f"{code} {phrase}")

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self._access(code)

    def _json(self, code: int, obj: dict[str, Any]) -> None:
        self._send(code, json.dumps(obj).encode())

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self.path == "/health":
            health = self.server.health
            if self.server.engine.dead is not None or (health is not None and health()):
                self._send(500, b"Internal Server Error", "text/plain; charset=utf-8")
            else:
                self._send(200, b"")
        elif self.path == "/v1/models":
            api = self.server.api
            now = int(time.time())
            data: list[dict[str, Any]] = [
                {"id": name, "object": "model", "created": now, "owned_by": "vllm",
                 "root": api.model_root, "parent": None, "max_model_len": api.max_model_len,
                 "permission": []}
                for name in api.served_names]
            self._json(200, {"object": "list", "data": data})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        if self.path != "/v1/completions":
            self._json(404, {"detail": "Not Found"})
            return
        try:
            length = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body is not an object")
        except ValueError as err:
            self._json(400, error_body(f"Invalid request body: {err}", "BadRequestError", 400))
            return
        self._complete(body)

    def _complete(self, body: dict[str, Any]) -> None:
        api = self.server.api
        model = body.get("model", api.served_names[0])
        if model not in api.served_names:
            self._json(404, error_body(f"The model `{model}` does not exist.", "NotFoundError",
                                       404))
            return
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not all(isinstance(t, int) for t in prompt):
                self._json(400, error_body("prompt must be a string or a list of token ids",
                                           "BadRequestError", 400))
                return
            prompt_len = len(prompt)
        else:
            prompt_len = count_tokens(str(prompt))
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else int(max_tokens)
        if prompt_len + max_tokens > api.max_model_len:
            self._json(400, error_body(context_error(api.max_model_len, prompt_len, max_tokens),
                                       "BadRequestError", 400))
            return
        rid = f"cmpl-{uuid.uuid4().hex}"
        self.server.log.info("logger.py:37", f"Received request {rid}-0: prompt: None, params: "
                             f"SamplingParams(n=1, max_tokens={max_tokens}), "
                             f"prompt_token_ids: [{prompt_len} tokens], lora_request: None, "
                             "prompt_adapter_request: None.")
        stream = bool(body.get("stream", False))
        tokens: queue.Queue[int] = queue.Queue()
        req = Request(rid, prompt_len, max_tokens, on_token=tokens.put if stream else None)
        try:
            self.server.engine.submit(req)
        except EngineDeadError:
            self._send(500, b"Internal Server Error", "text/plain; charset=utf-8")
            return
        self.server.log.info("engine.py:267", f"Added request {rid}-0.")
        try:
            if stream:
                self._stream(req, tokens, model)
            else:
                req.finished.wait()
                # A prompt the scheduler ignored is answered 200 with no output, as vLLM does.
                if req.error is not None:
                    self._send(500, b"Internal Server Error", "text/plain; charset=utf-8")
                    return
                self._json(200, {
                    "id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": 0, "text": detokenize(req.output), "logprobs": None,
                                 "finish_reason": "length", "stop_reason": None,
                                 "prompt_logprobs": None}],
                    "usage": {"prompt_tokens": prompt_len,
                              "total_tokens": prompt_len + len(req.output),
                              "completion_tokens": len(req.output),
                              "prompt_tokens_details": None},
                })
        finally:
            if self.server.on_request_done is not None:
                self.server.on_request_done()

    def _stream(self, req: Request, tokens: queue.Queue[int], model: str) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        created = int(time.time())

        def chunk(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        sent = 0
        while sent < req.max_tokens:
            tok = tokens.get()
            if tok == -2:  # ignored by the scheduler: an empty, finished choice
                chunk(json.dumps({"id": req.request_id, "object": "text_completion",
                                  "created": created, "model": model,
                                  "choices": [{"index": 0, "text": "", "logprobs": None,
                                               "finish_reason": "length",
                                               "stop_reason": None}]}))
                break
            if tok < 0:
                chunk(json.dumps(error_body("Internal Server Error", "InternalServerError",
                                            500)))
                break
            sent += 1
            last = sent == req.max_tokens
            chunk(json.dumps({"id": req.request_id, "object": "text_completion",
                              "created": created, "model": model,
                              "choices": [{"index": 0, "text": detokenize([tok]),
                                           "logprobs": None,
                                           "finish_reason": "length" if last else None,
                                           "stop_reason": None}]}))
        chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self._access(200)


def serve_in_thread(server: SimHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name="http", daemon=True)
    thread.start()
    return thread
