"""A stand-in for a vLLM server process, for the process-tree tests (stdlib only).

    fake_server.py --port P [--die-at-start CODE] [--hang] [--ignore-term]
                   [--term-delay S] [--wrapper]

--wrapper runs the server as a child under `subprocess.run`, like r0.1's launcher: the
wrapper dies at once on SIGTERM and the real server is then a grandchild of the test.
"""

from __future__ import annotations

import argparse
import http.server
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


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        status = 200 if self.path == "/health" else 404
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def serve(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        if args.ignore_term:
            say("got SIGTERM, ignoring it")
            return
        say("got SIGTERM")
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    say("starting")
    if args.die_at_start is not None:
        say("fatal: cannot start (simulated)")
        return int(args.die_at_start)
    if args.hang:
        # Accept connections into the backlog and never answer them.
        sock = socket.socket()
        sock.bind(("127.0.0.1", args.port))
        sock.listen(16)
        while not stop.wait(0.1):
            pass
        sock.close()
        return 0
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
    args, rest = parser.parse_known_args()
    if args.wrapper:
        argv = [a for a in sys.argv[1:] if a != "--wrapper"]
        say("wrapper starting the server")
        return subprocess.run([sys.executable, __file__, *argv], check=False).returncode
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
