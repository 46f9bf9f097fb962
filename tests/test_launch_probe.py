"""HTTP probes against a tiny real OpenAI-style server on loopback port 0."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pretuner.engines.outcome import tally
from pretuner.errors import RequestRefusedError, ServerFailedError
from pretuner.launch import probe
from pretuner.launch.probe import CompletionOutcome

MAX_MODEL_LEN = 64
SMALL_VOCAB = 4096  # the model "small-vocab" has this many token ids


@dataclass
class Recorder:
    requests: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    # A request waits (up to a bound) until this many are in flight: a sequential client
    # then shows max_in_flight == 1, a concurrent one shows all of them.
    gather: int = 1
    gathered: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)


class Handler(http.server.BaseHTTPRequestHandler):
    recorder: Recorder

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self.reply(200, {})
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})
        else:
            self.reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rec = self.recorder
        with rec.cond:
            rec.requests.append(body)
            rec.in_flight += 1
            rec.max_in_flight = max(rec.max_in_flight, rec.in_flight)
            if rec.in_flight >= rec.gather:
                rec.gathered = True  # sticky: the first to finish must not hold back the rest
            rec.cond.notify_all()
            rec.cond.wait_for(lambda: rec.gathered, timeout=3.0)
        try:
            self.answer(body)
        finally:
            with rec.cond:
                rec.in_flight -= 1

    def answer(self, body: dict[str, Any]) -> None:
        model, prompt, max_tokens = body["model"], body["prompt"], body["max_tokens"]
        if model == "boom":
            self.reply(500, {"error": {"message": "internal boom", "code": 500}})
        elif model == "die":
            self.close_connection = True  # hang up without an answer, like a crashed server
        elif model == "small-vocab" and max(prompt) >= SMALL_VOCAB:
            # vLLM 0.10+'s shape and wording
            self.reply(400, {"error": {"message": f"Token id {max(prompt)} is out of vocabulary",
                                       "type": "BadRequestError", "param": None, "code": 400}})
        elif len(prompt) + max_tokens > MAX_MODEL_LEN:
            # vLLM 0.6.6's shape and wording
            self.reply(
                400,
                {
                    "object": "error",
                    "message": f"This model's maximum context length is {MAX_MODEL_LEN} "
                    f"tokens. However, you requested {len(prompt) + max_tokens} tokens",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )
        else:
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens}
            self.reply(200, {"choices": [{"text": "x"}], "usage": usage})


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 64
    daemon_threads = True


@pytest.fixture
def server() -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    handler = type("BoundHandler", (Handler,), {"recorder": recorder})
    httpd = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", recorder
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_health_and_models(server: tuple[str, Recorder]) -> None:
    url, _ = server
    assert probe.get_ok(f"{url}/health", timeout_s=5)  # what readiness polls
    assert probe.served_models(url) == ["m1", "m2"]
    dead = f"http://127.0.0.1:{closed_port()}"
    assert not probe.get_ok(f"{dead}/health", timeout_s=1)
    with pytest.raises(ServerFailedError, match="v1/models"):
        probe.served_models(dead, timeout_s=1)


def test_probe_prompt_is_seeded_and_in_range() -> None:
    a = probe.probe_prompt(500, seed=1)
    assert a == probe.probe_prompt(500, seed=1)
    assert len(a) == 500
    assert all(probe.TOKEN_ID_LOW <= t <= probe.TOKEN_ID_HIGH for t in a)
    b = probe.probe_prompt(500, seed=2)
    assert a[:16] != b[:16]  # no shared first block for a prefix cache to reuse
    with pytest.raises(ValueError, match="at least 1"):
        probe.probe_prompt(0, seed=1)


@pytest.mark.parametrize(
    ("max_model_len", "max_tokens", "expected"),
    [(16384, 1, 16383), (64, 1, 63), (64, 16, 48), (2, 1, 1)],
)
def test_max_length_prompt_len(max_model_len: int, max_tokens: int, expected: int) -> None:
    assert probe.max_length_prompt_len(max_model_len, max_tokens) == expected


@pytest.mark.parametrize(("max_model_len", "max_tokens"), [(1, 1), (64, 0), (16, 16)])
def test_max_length_prompt_len_rejects(max_model_len: int, max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens|no room"):
        probe.max_length_prompt_len(max_model_len, max_tokens)


def test_max_length_probe_fits_and_one_more_is_refused(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    prompt_len = probe.max_length_prompt_len(MAX_MODEL_LEN, 1)
    fits = probe.complete(url, "m1", probe.probe_prompt(prompt_len, 7), 1, timeout_s=10)
    assert fits.ok
    assert fits.status == 200
    assert (fits.prompt_tokens, fits.completion_tokens) == (prompt_len, 1)
    assert fits.error is None
    sent = recorder.requests[0]
    assert sent["prompt"] == probe.probe_prompt(prompt_len, 7)
    assert sent["max_tokens"] == 1
    assert sent["temperature"] == 0
    assert sent["ignore_eos"] is True
    assert sent["model"] == "m1"

    too_long = probe.complete(url, "m1", probe.probe_prompt(prompt_len + 1, 7), 1, timeout_s=10)
    assert not too_long.ok
    assert too_long.status == 400
    assert too_long.error is not None
    assert "maximum context length is 64 tokens" in too_long.error
    assert too_long.prompt_tokens is None


def test_server_error_carries_the_message(server: tuple[str, Recorder]) -> None:
    url, _ = server
    outcome = probe.complete(url, "boom", [1000], 1, timeout_s=10)
    assert (outcome.status, outcome.ok, outcome.error) == (500, False, "internal boom")


def test_server_dying_mid_request_gives_status_0(server: tuple[str, Recorder]) -> None:
    url, _ = server
    outcome = probe.complete(url, "die", [1000], 1, timeout_s=10)
    assert outcome.status == 0
    assert not outcome.ok
    assert outcome.error


def test_connection_refused_gives_status_0() -> None:
    outcome = probe.complete(f"http://127.0.0.1:{closed_port()}", "m1", [1000], 1, timeout_s=5)
    assert outcome.status == 0
    assert not outcome.ok
    assert outcome.error is not None
    assert "ConnectionError" in outcome.error


def test_load_is_really_concurrent(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    recorder.gather = 6
    result = probe.load(url, "m1", 6, prompt_len=20, max_tokens=4, seed=3, timeout_s=20)
    assert result.all_ok
    assert len(result.outcomes) == 6
    assert recorder.max_in_flight == 6
    assert 0 < max(o.seconds for o in result.outcomes) <= result.wall_seconds < 20
    prompts = [tuple(r["prompt"]) for r in recorder.requests]
    assert len(set(prompts)) == 6  # each request its own prompt
    assert all(len(p) == 20 for p in prompts)
    assert all(r["max_tokens"] == 4 for r in recorder.requests)
    assert probe.probe_prompt(20, 3) not in [list(p) for p in prompts]


@pytest.mark.parametrize("vocab", [32, 4096, 32000, 151936])
def test_probe_prompt_stays_inside_the_vocabulary_away_from_its_ends(vocab: int) -> None:
    ids = probe.probe_prompt(2000, seed=5, vocab_size=vocab)
    # special and control ids sit at the low end, padding and more specials at the top
    assert min(256, vocab // 16) <= min(ids) <= max(ids) < vocab - vocab // 16
    assert max(ids) <= 30000  # a large vocabulary keeps the range every registry model holds


def test_small_vocabulary_prompts_are_accepted(server: tuple[str, Recorder]) -> None:
    url, _ = server
    plen = probe.max_length_prompt_len(MAX_MODEL_LEN, 1)
    assert probe.complete(url, "small-vocab", probe.probe_prompt(plen, 3, SMALL_VOCAB), 1,
                          timeout_s=10).ok
    burst = probe.load(url, "small-vocab", 3, plen, 1, seed=3, timeout_s=10,
                       vocab_size=SMALL_VOCAB)
    assert burst.all_ok, burst.outcomes
    # without the vocabulary, the ids reach 30,000: the server refuses them as vLLM does
    refused = probe.complete(url, "small-vocab", probe.probe_prompt(plen, 3), 1, timeout_s=10)
    assert refused.status == 400
    assert refused.error is not None
    assert "is out of vocabulary" in refused.error


def test_a_refused_request_is_pretuners_error_not_a_server_failure(
    server: tuple[str, Recorder],
) -> None:
    """A 4xx to pretuner's own request ends the run with exit 1 and the server's message; no
    verdict about the card or the server."""
    url, _ = server
    refused = probe.complete(url, "small-vocab", [29999] * 8, 1, timeout_s=10)
    with pytest.raises(RequestRefusedError) as caught:
        tally([CompletionOutcome(200, True, 0.1, 8, 1, None), refused], 8)
    assert int(caught.value.exit_code) == 1
    assert not isinstance(caught.value, ServerFailedError)
    assert "HTTP 400: Token id 29999 is out of vocabulary" in str(caught.value)
    assert "pretuner's error" in str(caught.value)


@pytest.mark.parametrize(
    ("status", "refused"),
    [(400, True), (404, True), (422, True), (500, False), (503, False), (0, False)],
)
def test_only_a_4xx_is_pretuners_error(status: int, refused: bool) -> None:
    failed = CompletionOutcome(status, False, 0.1, None, None, "what the server said")
    if refused:
        with pytest.raises(RequestRefusedError, match=f"HTTP {status}: what the server said"):
            tally([failed], 8)
    else:  # the server's failure (or its death): the launch's outcome says so
        ran = tally([failed, CompletionOutcome(200, True, 0.1, 8, 1, None)], 8)
        assert (ran.ok, ran.total) == (1, 2)
        assert ran.error is not None
        assert "what the server said" in ran.error


def test_load_reports_failures(server: tuple[str, Recorder]) -> None:
    url, _ = server
    result = probe.load(url, "m1", 3, prompt_len=MAX_MODEL_LEN, max_tokens=1, seed=1, timeout_s=10)
    assert not result.all_ok
    assert {o.status for o in result.outcomes} == {400}


def test_loopback_ignores_proxy_variables(
    server: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    dead_proxy = f"http://127.0.0.1:{closed_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    url, _ = server
    assert probe.get_ok(f"{url}/health", timeout_s=5)
    assert probe.complete(url, "m1", [1000], 1, timeout_s=10).ok
