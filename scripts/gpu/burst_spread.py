"""Measure on a real GPU what pretuner's proof does not yet cover: a full-width burst of short
requests, and how much the same configuration's peak moves from one boot to the next.

Each boot starts real `vllm serve` with one pinned KV size (the proven one), then runs, in this
order: (1) one max-length request and (2) N concurrent ones, pretuner's proof load; (3) a
burst of `--burst` concurrent short requests (128 prompt + 128 output tokens, all running at
once); (4) the same burst again. NVML is sampled every 20 ms all the while (pretuner's `NvmlReader`,
the requests are pretuner's `probe.load`). One JSON object per boot goes to stdout and to
OUT/burst_spread.jsonl; the server logs and the memory series go to OUT/boots.tgz.

    OUT=/tmp/o PYTHONPATH=$PWD python3 scripts/gpu/burst_spread.py --model DIR \
        --kv-bytes 130202730496 --max-model-len 32768 --concurrent 26 --budget-s 450
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pretuner.devices.nvidia import NvmlReader, load_nvml
from pretuner.launch import probe

BOOT_WORST_S = 150  # the longest boot + load seen on the H200 (ready 119 s, load about 30 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Series:
    """NVML's used MiB every 20 ms, with the phase it was taken in."""

    def __init__(self, reader: NvmlReader) -> None:
        self.reader = reader
        self.phase = "boot"
        self.points: list[tuple[float, str, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            if (s := self.reader.sample()) is not None:
                self.points.append((t, self.phase, s.worst_used_mib))
            time.sleep(max(0.0, 0.02 - (time.monotonic() - t)))

    def peak(self, phase: str) -> int | None:
        return max((u for _, p, u in self.points if p == phase), default=None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def outcome(load: probe.LoadOutcome) -> dict[str, Any]:
    failed = [o for o in load.outcomes if not o.ok]
    return {"requests": len(load.outcomes), "failed": len(failed),
            "wall_s": round(load.wall_seconds, 2), "first_error": failed[0].error if failed else None}


def boot(args: argparse.Namespace, n: int, work: Path, reader: NvmlReader) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*shlex.split(args.serve), str(args.model), "--load-format", "dummy", "--port", str(port),
            "--kv-cache-memory-bytes", str(args.kv_bytes),
            "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.burst), "--max-num-batched-tokens", str(args.batched),
            "--served-model-name", "m"]
    log = (work / f"boot-{n}.log").open("wb")
    series = Series(reader)
    t0 = time.monotonic()
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rec: dict[str, Any] = {"boot": n, "argv": argv}
    try:
        while not probe.get_ok(f"{url}/v1/models", 2.0):
            if server.poll() is not None:
                rec["died_at_start"] = server.returncode
                log.flush()
                rec["log_tail"] = (work / f"boot-{n}.log").read_text(errors="replace")[-2000:]
                return rec
            time.sleep(0.5)
        rec["ready_s"] = round(time.monotonic() - t0, 1)
        series.phase = "idle"
        time.sleep(2.0)
        rec["idle_mib"] = series.peak("idle")
        prompt_len = probe.max_length_prompt_len(args.max_model_len, 32)
        phases = [("single", 1, prompt_len, 32), ("proof", args.concurrent, prompt_len, 32),
                  ("burst1", args.burst, 128, 128), ("burst2", args.burst, 128, 128)]
        for k, (phase, width, length, tokens) in enumerate(phases):
            series.phase = phase
            rec[phase] = outcome(probe.load(url, "m", width, length, tokens, 100 * n + k, 300.0,
                                            args.vocab))
            rec[phase]["peak_mib"] = series.peak(phase)
        series.phase = "after"
        time.sleep(1.0)
        rec["after_mib"] = series.peak("after")
        rec["total_mib"] = reader.sample().devices[0].total_mib  # type: ignore[union-attr]
        return rec
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        series.close()
        log.close()
        rec["alive_at_end"] = server.returncode is None
        (work / f"boot-{n}.tsv").write_text("".join(f"{t - t0:.3f}\t{p}\t{u}\n"
                                                   for t, p, u in series.points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--kv-bytes", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--concurrent", type=int, default=26)
    parser.add_argument("--burst", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batched", type=int, default=8192)
    parser.add_argument("--boots", type=int, default=3)
    parser.add_argument("--serve", default="vllm serve", help="the command before the model")
    parser.add_argument("--budget-s", type=float, default=450.0)
    args = parser.parse_args()
    out = Path(os.environ["OUT"])
    work = Path(tempfile.mkdtemp(prefix="boots-"))
    nvml = load_nvml()
    if nvml is None:
        raise SystemExit("NVML is not available")
    reader = NvmlReader(nvml)
    end = time.monotonic() + args.budget_s
    with (out / "burst_spread.jsonl").open("w") as sink:
        for n in range(1, args.boots + 1):
            if end - time.monotonic() < BOOT_WORST_S:
                print(f"boot {n} skipped: {end - time.monotonic():.0f} s of budget left")
                break
            rec = boot(args, n, work, reader)
            line = json.dumps(rec)
            print(line, flush=True)
            sink.write(line + "\n")
            sink.flush()
    with tarfile.open(out / "boots.tgz", "w:gz") as tar:
        tar.add(work, arcname="boots")


if __name__ == "__main__":
    main()
