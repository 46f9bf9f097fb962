"""The emulated servers' shared HTTP front: an OpenAI-compatible API on the standard library.

`Handler` owns the socket, body parsing, model check, access lines and completion bodies; what
a route answers is the personality's subclass (`r01_http`: vLLM 0.6.6, `v1.http`: vLLM 0.24)."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

_WORDS = ("the", "card", "memory", "pool", "token", "block", "cache", "model", "ascend", "peak")
PHRASES = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           500: "Internal Server Error", 503: "Service Unavailable"}
ANY_HOST = "0.0.0.0"  # noqa: S104 - vLLM's default binds every interface


def count_tokens(text: str) -> int:
    """The emulator's tokenizer: about one token per four characters, at least one."""
    return max(1, -(-len(text) // 4))


def detokenize(tokens: list[int]) -> str:
    return "".join(" " + _WORDS[t % len(_WORDS)] for t in tokens)


def prompt_length(prompt: object) -> int | None:
    """Tokens of a prompt given as text or token ids (a batch of one); None when invalid."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return len(prompt) if all(isinstance(t, int) for t in prompt) else None
    return count_tokens(prompt) if isinstance(prompt, str) else None


def usage(prompt_len: int, generated: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_len, "total_tokens": prompt_len + generated,
            "completion_tokens": generated, "prompt_tokens_details": None}


def completion(rid: str, model: str, text: str, prompt_len: int,
               generated: int) -> dict[str, Any]:
    """A finished `/v1/completions` answer (every emulated request stops at its max_tokens)."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "prompt_logprobs": None}],
            "usage": usage(prompt_len, generated)}


def stream_choice(head: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
    """One streamed `/v1/completions` event: `head` (id, object, created, model) + a token."""
    return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish, "stop_reason": None}]}


def access_line(host: str, port: int, method: str, path: str, code: int) -> str:
    """uvicorn's access line (without its `INFO:` prefix)."""
    return f'{host}:{port} - "{method} {path} HTTP/1.1" {code} {PHRASES.get(code, "")}'


def print_routes(info: Callable[[str, str], None], where: tuple[str, str],
                 routes: Sequence[tuple[str, str]]) -> None:
    """vLLM's `Available routes are:` block, logged from `where` (the head's, each route's)."""
    info(where[0], "Available routes are:")
    for route, methods in routes:
        info(where[1], f"Route: {route}, Methods: {methods}")


def uvicorn_started(log: AccessLog, pid: int) -> None:
    for line in (f"Started server process [{pid}]", "Waiting for application startup.",
                 "Application startup complete."):
        log.uvicorn(line)


@dataclass(frozen=True, slots=True)
class Reply:
    """What one completion request got, as the HTTP client would see it (in-process runs)."""

    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ApiConfig:
    served_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    api_keys: tuple[str, ...] = ()


class AccessLog(Protocol):
    def uvicorn(self, msg: str) -> None: ...


class FrontServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # uvicorn's listen backlog; the standard library's 5 resets connections when a full load
    # of max-num-seqs clients connects at once, which the real server never does.
    request_queue_size = 2048

    def __init__(self, addr: tuple[str, int], handler: type[Handler], api: ApiConfig,
                 log: AccessLog) -> None:
        super().__init__(addr, handler)
        self.api = api
        self.log = log
        self.busy: set[socket.socket] = set()  # connections with a request in progress
        self.busy_lock = threading.Lock()

    def close_gracefully(self, poll_s: float = 0.05) -> None:
        """Stop accepting, then wait while a request is in progress and its client still
        connected, as uvicorn does on SIGTERM (vLLM aborts a request whose client left)."""
        self.shutdown()
        said = False
        while True:
            with self.busy_lock:
                waiting = [sock for sock in self.busy if _client_open(sock)]
            if not waiting:
                return
            if not said:
                self.log.uvicorn("Waiting for connections to close. (CTRL+C to force quit)")
                said = True
            time.sleep(poll_s)


def _client_open(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return not readable or sock.recv(1, socket.MSG_PEEK) != b""
    except (OSError, ValueError):
        return False


class Handler(BaseHTTPRequestHandler):
    """The routes both personalities share; a subclass answers health and completions."""

    protocol_version = "HTTP/1.1"
    server: FrontServer
    separators: tuple[str, str] | None = None  # json.dumps'; None: Python's default
    chunked = False  # streams in chunks (r0.1), else until the connection closes (V1)
    posts: tuple[str, ...] = ("/v1/completions",)
    not_object = "body is not an object"

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:  # a request in progress until handle_one_request returns
            with self.server.busy_lock:
                self.server.busy.add(self.connection)
        return parsed

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        finally:
            with self.server.busy_lock:
                self.server.busy.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        return  # uvicorn-style access lines are written by _access()

    def error_body(self, message: str, kind: str, code: int) -> dict[str, Any]:
        raise NotImplementedError

    def health(self) -> None:
        raise NotImplementedError

    def post(self, body: dict[str, Any]) -> None:
        raise NotImplementedError

    def _access(self, code: int) -> None:
        host, port = self.client_address[:2]
        self.server.log.uvicorn(access_line(host, port, self.command, self.path, code))

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self._access(code)

    def _json(self, code: int, obj: dict[str, Any]) -> None:
        self._send(code, json.dumps(obj, separators=self.separators).encode())

    def _error(self, code: int, message: str, kind: str = "BadRequestError") -> None:
        self._json(code, self.error_body(message, kind, code))

    def _open_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        if self.chunked:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()

    def _event(self, obj: dict[str, Any] | str) -> None:
        """A server-sent event: `data: ...` and a blank line."""
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=self.separators)
        raw = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n" if self.chunked else raw)
        self.wfile.flush()

    def _close_stream(self) -> None:
        self._event("[DONE]")
        if self.chunked:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        self._access(200)

    def _refused(self) -> bool:
        """vLLM's API-key check: a /v1 route without `Authorization: Bearer KEY` gets 401."""
        keys = self.server.api.api_keys
        if not keys or not self.path.startswith("/v1") or self.headers.get(
                "authorization") in {f"Bearer {k}" for k in keys}:
            return False
        self._json(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self._refused():
            return
        if self.path == "/health":
            self.health()
        elif self.path == "/v1/models":
            api = self.server.api
            now = int(time.time())
            self._json(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": now, "owned_by": "vllm",
                 "root": api.model_root, "parent": None, "max_model_len": api.max_model_len,
                 "permission": []} for name in api.served_names]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        if self._refused():
            return
        if self.path not in self.posts:
            self._json(404, {"detail": "Not Found"})
            return
        try:
            length = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError(self.not_object)
        except ValueError as err:
            self._error(400, f"Invalid request body: {err}")
            return
        self.post(body)

    def _model(self, body: dict[str, Any]) -> str | None:
        """The served name a request asks for; None once its 404 was answered."""
        api = self.server.api
        model = body.get("model", api.served_names[0])
        if model not in api.served_names:
            self._error(404, f"The model `{model}` does not exist.", "NotFoundError")
            return None
        return str(model)


def serve_in_thread(server: FrontServer, poll_s: float = 0.1) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": poll_s},
                              name="http", daemon=True)
    thread.start()
    return thread
