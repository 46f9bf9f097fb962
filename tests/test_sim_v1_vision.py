"""The emulated vLLM 0.24 server serving a vision-language model (Qwen3-VL), against the field
notes (../shared/seeds/000_*, 001_*: vllm-ascend, 64 GB cards, TP2).

In process for the figures (profiling's encoder moment, growth after 1,000 image prompts, the
truth with and without a soak); a real subprocess server on port 0 for the chat API, vLLM's
400s and `/reset_mm_cache` giving nothing back.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pretuner.launch import images as I
from pretuner.launch.png import png_bytes, png_data_url, png_size
from pretuner.models import resolve
from pretuner.models.vision import image_tokens, max_image_tokens
from pretuner.sim.reader import EmulatedReader
from pretuner.sim.v1 import inproc
from pretuner.sim.v1.chat import (
    ASSISTANT_TOKENS,
    IMAGE_WRAP_TOKENS,
    MESSAGE_TOKENS,
    ChatError,
    parse_chat,
    prompt_of,
)
from pretuner.sim.v1.config import UsageError, parse
from pretuner.sim.v1.mm import vision_card
from pretuner.sim.v1.truth import Images, max_kv_bytes, survives
from pretuner.units import GIB

ENV = {"PRETUNER_SIM_PROFILE": "cuda-64", "PRETUNER_SIM_SEED": "0",
       "PRETUNER_SIM_OCCUPIED_MIB": "0", "PRETUNER_SIM_STARTUP_S": "0.02"}
# Seed 000 (Qwen3-VL-8B, TP2): the server's shape; pinned KV instead of util 0.95 so that the
# figures do not depend on whether 0.95 survives.
VL8 = ["qwen3-vl-8b", "-tp", "2", "--max-model-len", "65536", "--max-num-seqs", "8",
       "--max-num-batched-tokens", "32768"]
SEED_001_GROWTH_MIB = 61548 - 57766  # "压测之后" - "服务启动后", seed 001


def vl8_card() -> Any:
    spec = resolve("qwen3-vl-8b")
    assert spec.vision is not None
    return vision_card(spec.vision, tp=2, dtype_bytes=2, seed=0, image_limit=None,
                       max_model_len=65536, max_num_seqs=8, max_num_batched_tokens=32768)


# -- start-up ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "line"), [
    pytest.param(VL8, "budget of 32768 tokens, and profiled with 2 image items", id="seed000-8b"),
    pytest.param(["qwen3-vl-32b", "-tp", "2", "--max-model-len", "16384", "--max-num-seqs", "4"],
                 "budget of 16384 tokens, and profiled with 1 image items", id="seed001-32b"),
])
def test_start_up_logs_vllms_encoder_budget_line(argv: list[str], line: str) -> None:
    res = inproc.run_waves([*argv, "--kv-cache-memory-bytes", "8G"], ENV, [])
    assert res.ready, res.log[-2000:]
    assert f"Encoder cache will be initialized with a {line} of the maximum feature size." \
        in res.log


def test_text_models_log_no_encoder_line() -> None:
    res = inproc.run_waves(["qwen3-8b", "--kv-cache-memory-bytes", "8G"], ENV, [])
    assert res.ready
    assert "Encoder cache" not in res.log


def test_profiling_figures_of_seed_000() -> None:
    card = vl8_card()
    one = max_image_tokens(card.vision)
    assert (one, card.budget_tokens, card.profiled) == (16384, 32768, 2)
    # "forward_oot 峰值激活: 3.8 G" for 2 images, "1.884 G" for one, "image_cache: 1 G".
    assert card.activation_bytes(2 * one) / GIB == pytest.approx(3.8, abs=0.05)
    assert card.activation_bytes(one) / GIB == pytest.approx(1.884, abs=0.01)
    assert card.output_bytes(card.budget_tokens) == GIB
    # The note's "2.25 G ?": outputs beside an 32,768-token dummy step; the encoder wins.
    step = 32768 * 2 * (3 * 12288 // 2 + 4096 // 2)
    assert (card.output_bytes(2 * one) + step) / GIB == pytest.approx(2.25, abs=0.01)
    assert card.profile_bytes(step) == card.activation_bytes(2 * one)


def test_profiling_sees_the_encoder_so_util_mode_gives_less_kv() -> None:
    def available(argv: list[str]) -> float:
        log = inproc.run_waves([*argv, "--gpu-memory-utilization", "0.9"], ENV, []).log
        return float(re.findall(r"Available KV cache memory: ([\d.]+) GiB", log)[0])

    with_images = available(VL8)
    text_only = available([*VL8, "--limit-mm-per-prompt", "image=0"])
    assert text_only - with_images == pytest.approx((3.77 - 2 * 0.625), abs=0.05)


# -- images at run time ------------------------------------------------------------------------


def arena(i: int) -> I.MMRequest:
    """A VisionArena-like prompt (seed 001's benchmark): one photo-sized image, a question."""
    spec = resolve("qwen3-vl-8b")
    assert spec.vision is not None
    rng = random.Random(f"arena/{i}")
    w, h = rng.choices(I.SOAK_SIDES_PX[:7], weights=I.SOAK_SIDE_WEIGHTS[:7], k=2)
    image = I.ImageAsk(w, h, f"arena/{i}", image_tokens(spec.vision, h, w))
    return I.MMRequest((image,), rng.randint(32, 256), 64)


@pytest.mark.slow
def test_memory_grows_after_1000_image_prompts_as_in_seed_001() -> None:
    reqs = tuple(arena(i) for i in range(1000))
    res = inproc.run_waves([*VL8, "--kv-cache-memory-bytes", "30G"], ENV,
                           [I.LoadPhase("load", reqs, concurrency=8, reset=True)])
    assert all(r.status == 200 for r in res.replies)
    growth = res.last_mib["load"] - res.last_mib["start"]
    assert growth == pytest.approx(SEED_001_GROWTH_MIB, rel=0.10)


@pytest.mark.slow
def test_growth_needs_distinct_images_and_never_shrinks() -> None:
    same = arena(0)
    argv = [*VL8, "--kv-cache-memory-bytes", "30G"]
    repeated = inproc.run_waves(argv, ENV, [I.LoadPhase("load", (same,) * 200, 8)])
    distinct = tuple(arena(i) for i in range(200))
    fresh = inproc.run_waves(argv, ENV, [I.LoadPhase("a", distinct[:100], 8),
                                         I.LoadPhase("b", distinct[100:], 8, reset=True),
                                         I.LoadPhase("idle", ())])
    grown = fresh.last_mib["b"] - fresh.last_mib["start"]
    assert repeated.last_mib["load"] - repeated.last_mib["start"] < grown / 2
    assert fresh.last_mib["a"] <= fresh.last_mib["b"] == fresh.last_mib["idle"]


@pytest.mark.slow
def test_a_configuration_proven_at_start_up_fails_under_a_soak() -> None:
    spec = resolve("qwen3-vl-8b")

    def kv(soak: int) -> int:
        return max_kv_bytes(spec, "cuda-64", images=Images(soak=soak), seed=0,
                            max_model_len=65536, max_num_seqs=8, max_num_batched_tokens=32768,
                            tp=2)

    fresh, soaked, longer = kv(0), kv(200), kv(600)
    assert longer <= soaked < fresh - GIB  # the soak takes over a GiB of what start-up allowed
    argv = ["qwen3-vl-8b", "--max-model-len", "65536", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "32768", "-tp", "2",
            "--kv-cache-memory-bytes", str(fresh)]
    env = {**ENV, "PRETUNER_SIM_STARTUP_S": "0"}
    assert survives(spec, argv, env, Images(soak=0))
    assert not survives(spec, argv, env, Images(soak=200))


# -- the chat request, pure --------------------------------------------------------------------


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def image_part(w: int, h: int, uid: str = "x") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_data_url(w, h, uid)}}


@pytest.mark.slow
def test_chat_prompt_counts_template_images_and_text() -> None:
    card = vl8_card()
    p = parse_chat(chat(image_part(4096, 4096), image_part(640, 480, "y"),
                        {"type": "text", "text": "a" * 400}), card)
    assert [i.tokens for i in p.images] == [16384, image_tokens(card.vision, 480, 640)]
    assert p.images[0].offset == MESSAGE_TOKENS + 1
    assert p.prompt_len == (MESSAGE_TOKENS + sum(i.tokens + IMAGE_WRAP_TOKENS for i in p.images)
                            + 100 + ASSISTANT_TOKENS)
    again = parse_chat(chat(image_part(4096, 4096)), card)
    other = parse_chat(chat(image_part(4096, 4096, "z")), card)
    assert again.images[0].key == p.images[0].key != other.images[0].key
    req = I.worst_case(I.image_shape(card.vision, 2), 65536, 16, "w", MESSAGE_TOKENS
                       + ASSISTANT_TOKENS)
    assert prompt_of(req).prompt_len == 65536 - 16


@pytest.mark.parametrize(("body", "limit", "text"), [
    pytest.param(chat(image_part(64, 64), image_part(64, 64, "b")), 1,
                 "At most 1 image(s) may be provided in one prompt. Set `--limit-mm-per-prompt` "
                 "to increase this limit.", id="over-the-limit"),
    pytest.param(chat(image_part(64, 64)), 0, "At most 0 image(s)", id="limit-zero"),
    pytest.param(chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}),
                 2, "does not decode", id="bad-base64"),
    pytest.param(chat({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"GIF89a....").decode()}}), 2,
        "cannot identify image file", id="not-a-png"),
    pytest.param(chat({"type": "image_url", "image_url": {"url": "http://x/y.png"}}), 2,
                 "data:image", id="remote-url"),
    pytest.param({"messages": []}, 2, "non-empty", id="no-messages"),
    pytest.param(chat({"type": "input_audio"}), 2, "unsupported content part", id="audio"),
])
def test_chat_refusals(body: dict[str, Any], limit: int, text: str) -> None:
    card = vl8_card()
    from dataclasses import replace
    with pytest.raises(ChatError, match=re.escape(text)):
        parse_chat(body, replace(card, image_limit=limit))


def test_text_model_refuses_images() -> None:
    with pytest.raises(ChatError, match="At most 0 image"):
        parse_chat(chat(image_part(64, 64)), None)


@pytest.mark.parametrize(("argv", "limit"), [
    pytest.param(["m", "--limit-mm-per-prompt", "image=2"], 2, id="pairs"),
    pytest.param(["m", "--limit-mm-per-prompt", '{"image": 3, "video": 0}'], 3, id="json"),
    pytest.param(["m", "--limit-mm-per-prompt.image=1"], 1, id="dotted"),
    pytest.param(["m", "--limit-mm-per-prompt.video", "0"], None, id="dotted-video-only"),
    pytest.param(["m"], None, id="default"),
])
def test_command_line_image_limit(argv: list[str], limit: int | None) -> None:
    assert parse(argv, {}).image_limit == limit


def test_command_line_refuses_a_bad_limit() -> None:
    with pytest.raises(UsageError, match="limit-mm-per-prompt"):
        parse(["m", "--limit-mm-per-prompt", "image=two"], {})


def test_png_header_round_trip_and_distinct_content() -> None:
    a, b = png_bytes(300, 200, "a"), png_bytes(300, 200, "b")
    assert png_size(a) == png_size(b) == (300, 200)
    assert a != b
    assert png_bytes(300, 200, "a") == a
    assert png_size(b"GIF89a" + bytes(30)) is None
    with pytest.raises(ValueError, match="outside"):
        png_bytes(1, 5, "x")


# -- the subprocess server over HTTP ------------------------------------------------------------


class Server:
    """`python -m pretuner.sim vllm serve` for a VL model on port 0."""

    def __init__(self, tmp: Path, args: list[str], dev: bool) -> None:
        self.env = {**os.environ, **ENV, "PRETUNER_SIM_STATE_DIR": str(tmp / "state")}
        self.env.pop("CUDA_VISIBLE_DEVICES", None)
        if dev:
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
        self.log_path = tmp / "server.log"
        self.reader = EmulatedReader(self.env, frozenset({0, 1}))
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pretuner.sim", "vllm", "serve", *args, "--host",
                 "127.0.0.1", "--port", "0"], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            text = self.log()
            m = re.search(r"Starting vLLM server on http://127\.0\.0\.1:(\d+)", text)
            # Ready once uvicorn says so: the routes are logged between the two lines.
            if m and "Application startup complete." in text:
                self.port = int(m.group(1))
                return
            time.sleep(0.02)
        raise AssertionError("not ready: " + self.log()[-2000:])

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def used_mib(self) -> int:
        sample = self.reader.sample()
        assert sample is not None
        return sample.worst_used_mib

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     method="POST", headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                raw = r.read()
                return int(r.status), json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw) if raw else None


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(args: list[str], dev: bool = False) -> Server:
        started.append(Server(tmp_path / str(len(started)), args, dev))
        return started[-1]

    yield start
    for s in started:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGTERM)
            s.proc.wait(timeout=20)


@pytest.mark.slow
def test_http_chat_with_images_then_reset_gives_nothing_back(serve: Any, tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()
    s = serve([*VL8, "--kv-cache-memory-bytes", "30G", "--limit-mm-per-prompt", "image=2"],
              dev=True)
    assert "Route: /reset_mm_cache, Methods: POST" in s.log()
    before = s.used_mib()
    body = {"model": "qwen3-vl-8b", "max_tokens": 4,
            **chat(image_part(4096, 4096, "h1"), image_part(1024, 768, "h2"),
                   {"type": "text", "text": "describe " * 40})}
    status, reply = s.post("/v1/chat/completions", body)
    assert status == 200, reply
    expected = (MESSAGE_TOKENS + 16384 + 768 + 2 * IMAGE_WRAP_TOKENS + 90 + ASSISTANT_TOKENS)
    assert reply["usage"] == {"prompt_tokens": expected, "completion_tokens": 4,
                              "total_tokens": expected + 4, "prompt_tokens_details": None}
    assert reply["choices"][0]["message"]["role"] == "assistant"
    for i in range(6):  # distinct images of new shapes: the card keeps more each time
        w = 512 + 448 * i
        assert s.post("/v1/chat/completions", {"model": "qwen3-vl-8b", "max_tokens": 2,
                                               **chat(image_part(w, w, f"g{i}"))})[0] == 200
    time.sleep(0.15)
    after = s.used_mib()
    assert after > before + 1024  # the encoder cache and torch's blocks: over a GiB
    assert s.post("/reset_mm_cache") == (200, None)
    time.sleep(0.15)
    assert s.used_mib() == after  # vLLM's reset empties the host-side cache only
    too_many = chat(image_part(64, 64, "a"), image_part(64, 64, "b"), image_part(64, 64, "c"))
    status, err = s.post("/v1/chat/completions", too_many)
    assert status == 400
    assert err["error"]["message"].startswith("At most 2 image(s)")
    long_text = chat(image_part(4096, 4096, "l"), {"type": "text", "text": "x" * 4 * 50000})
    status, err = s.post("/v1/chat/completions", {**long_text, "max_tokens": 4})
    assert status == 400
    assert "maximum context length is 65536 tokens" in err["error"]["message"]


@pytest.mark.slow
def test_http_reset_needs_dev_mode(serve: Any, tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()
    s = serve([*VL8, "--kv-cache-memory-bytes", "30G"])
    assert "Route: /reset_mm_cache" not in s.log()
    assert s.post("/reset_mm_cache")[0] == 404
