"""A stand-in for a vLLM server process, for the process-tree and fault tests (stdlib only).

    fake_server.py --port P [--die-at-start CODE] [--hang] [--ignore-term]
                   [--term-delay S] [--wrapper] [--fault MODE]

--wrapper runs the server as a child under `subprocess.run`, like r0.1's launcher: the
wrapper dies at once on SIGTERM and the real server is then a grandchild of the test.

--fault (or FAKE_SERVER_FAULT) injects one failure into an otherwise well-behaved server that
answers `/health`, `/v1/models` and `/v1/completions` (with `usage`) and prints a pool dump
line at SIGTERM; `pretuner run --serve-cmd` drives it (unknown flags are ignored):
  die-on-probe  exit 7 on the first completion request, no answer, no OOM line
  http-500      answer every completion with HTTP 500 and no OOM line
  vocab         a vocabulary of FAKE_SERVER_VOCAB (default 4096) ids: a prompt with an id beyond
                it gets vLLM's HTTP 400 "Token id N is out of vocabulary"; the log names the
                lowest and highest id of every prompt
  hang          accept connections and never answer (not even /health)
  ignore-term   serve normally, ignore SIGTERM (must be killed after the grace period)
  garbage       serve normally, with non-UTF-8 bytes in its log (stdout)
  busy          hold card memory as another tenant of the emulated card: publish this pid
                and FAKE_SERVER_HOLD_MIB (default 40000) in $PRETUNER_SIM_STATE_DIR, then idle
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def say(text: str) -> None:
    sys.stdout.write(f"fake[{os.getpid()}] {text}\n")
    sys.stdout.flush()


FAULTS = ("die-on-probe", "http-500", "hang", "ignore-term", "garbage", "busy", "vocab")
GARBAGE = b"\xff\xfe garbage \xc3\x28 \x80\x81 not utf-8 \xed\xa0\x80\n"


class Health(http.server.BaseHTTPRequestHandler):
    fault: str | None = None
    model = "fake"

    def _send(self, status: int, body: dict[str, object] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.model}]})
            return
        self._send(200 if self.path == "/health" else 404)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            body = {}
        if self.path != "/v1/completions":
            self._send(404)
            return
        if self.fault == "die-on-probe":
            say("fatal: segmentation fault in the attention kernel (simulated)")
            os._exit(7)
        if self.fault == "http-500":
            say("ERROR: internal error while running the request (simulated, no OOM)")
            self._send(500, {"object": "error", "message": "Internal Server Error (simulated)"})
            return
        if self.fault == "garbage":
            sys.stdout.buffer.write(GARBAGE)
            sys.stdout.flush()
        prompt = body.get("prompt")
        tokens = len(prompt) if isinstance(prompt, list) else 1
        if self.fault == "vocab" and isinstance(prompt, list) and prompt:
            vocab = int(os.environ.get("FAKE_SERVER_VOCAB", "4096"))
            say(f"prompt token ids {min(prompt)}-{max(prompt)}")
            if max(prompt) >= vocab:  # vLLM 0.10+'s shape and wording
                self._send(400, {"error": {
                    "message": f"Token id {max(prompt)} is out of vocabulary",
                    "type": "BadRequestError", "param": None, "code": 400}})
                return
        gen = int(body.get("max_tokens") or 1)
        self._send(200, {
            "object": "text_completion",
            "choices": [{"index": 0, "text": " x" * gen, "finish_reason": "length"}],
            "usage": {"prompt_tokens": tokens, "completion_tokens": gen,
                      "total_tokens": tokens + gen},
        })

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def hold_card(mib: int) -> None:
    """Publish this process as a tenant of every emulated card: npu-smi shows its pid."""
    state = os.environ.get("PRETUNER_SIM_STATE_DIR")
    if not state:
        say("busy: PRETUNER_SIM_STATE_DIR is not set")
        return
    os.makedirs(state, exist_ok=True)
    for npu in range(8):
        path = os.path.join(state, f"npu-node0-dev{npu}-pid{os.getpid()}.json")
        data = {"pid": os.getpid(), "shown_pid": os.getpid(), "process_mib": mib}
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(path + ".tmp", path)
    say(f"busy: holding {mib} MiB of every card")


def serve(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        if args.ignore_term:
            say("got SIGTERM, ignoring it")
            return
        say("got SIGTERM")
        stop.set()
    if args.fault == "ignore-term":
        args.ignore_term = True

    signal.signal(signal.SIGTERM, on_term)
    say("starting")
    if args.fault == "garbage":
        sys.stdout.buffer.write(GARBAGE)
        sys.stdout.flush()
    if args.fault == "busy":
        hold_card(int(os.environ.get("FAKE_SERVER_HOLD_MIB", "40000")))
    if args.die_at_start is not None:
        say("fatal: cannot start (simulated)")
        return int(args.die_at_start)
    if args.hang or args.fault == "hang":
        # Accept connections into the backlog and never answer them.
        sock = socket.socket()
        sock.bind(("127.0.0.1", args.port))
        sock.listen(16)
        while not stop.wait(0.1):
            pass
        sock.close()
        return 0
    Health.fault = args.fault
    Health.model = args.served_model_name or args.model or "fake"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Health)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    say("ready")
    while not stop.wait(0.1):
        pass
    time.sleep(args.term_delay)
    server.shutdown()
    server.server_close()
    say("actual peak used mem:1234M")
    say("exiting")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--die-at-start", type=int)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--term-delay", type=float, default=0.0)
    parser.add_argument("--wrapper", action="store_true")
    parser.add_argument("--fault", choices=FAULTS, default=os.environ.get("FAKE_SERVER_FAULT"))
    parser.add_argument("--model")
    parser.add_argument("--served-model-name")
    args, rest = parser.parse_known_args()
    if args.wrapper:
        argv = [a for a in sys.argv[1:] if a != "--wrapper"]
        say("wrapper starting the server")
        return subprocess.run([sys.executable, __file__, *argv], check=False).returncode
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
