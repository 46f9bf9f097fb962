"""Benchmark the V1 method on the real vLLM on CPU under a memory budget (issue 16).

1. The tuning: `pretuner run --model <tiny Qwen3> --engine vllm-cpu --card 6 --server-arg
   '--load-format dummy'` as a user runs it; from its report.json the validated
   `--kv-cache-memory-bytes`, its launches, and the run's wall time.
2. The truth: the largest pinned KV that truly holds the worst-case load, found by bisection on
   real launches of the same server (the exact argv and environment of the run's validating
   launch, only `--kv-cache-memory-bytes` and `--port` changed), each exercised as pretuner's
   validation does (`V1Hooks.exercise`: one max-length request alone, then as many concurrent
   max-length requests as the KV cache holds, at most max-num-seqs). A KV holds when the
   server becomes ready, every request is answered 200 with tokens, and it is still alive.
   Between the found KV (proven by the run) and the budget, or found + 512 MiB when less,
   down to 8 MiB, at most --max-bisect launches.

Targets: found / maximum >= 0.97, no undetected OOM (found > maximum), <= 4 tuning launches.
Exit 1 when one fails; 0 with a message when vllm-cpu is not installed. About 10-15 minutes
on 2 cores (a launch is ready after 45-70 s).

    python scripts/bench_vllm_cpu.py [--card 6] [--max-bisect 6] [--resolution-mib 8]
        [--span-mib 512] [--recheck-found] [--tuned RUN_DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pretuner.engines.base import LaunchSettings
from pretuner.engines.v1_launch import V1Hooks, read_log
from pretuner.engines.vllm_v1 import ROWS, engine_python
from pretuner.errors import ServerFailedError
from pretuner.kvmath import kv_bytes_per_token
from pretuner.launch.command import LaunchCommand
from pretuner.launch.process import ServerProcess
from pretuner.models import resolve
from pretuner.tune.execute import LaunchContext, free_port
from pretuner.units import GIB, MIB

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3"
KV_FLAG = "--kv-cache-memory-bytes"
TARGET_RATIO = 0.97
TARGET_LAUNCHES = 4
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
STOP_GRACE_S = 60.0


@dataclass(frozen=True, slots=True)
class Tuned:
    """What the tuning run proved, and the launch that proved it."""

    kv_bytes: int
    launches: int
    wall_s: float
    budget_bytes: int
    settings: LaunchSettings  # the validating launch's
    command: LaunchCommand  # its argv and the environment pretuner added
    served_name: str
    host: str
    bytes_per_token: int


@dataclass(frozen=True, slots=True)
class Probe:
    kv_bytes: int
    held: bool
    why: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Bisection:
    """`lo_bytes` holds; `hi_bytes` died (or is the untested top when `hi_died` is False)."""

    lo_bytes: int
    hi_bytes: int
    hi_died: bool
    probes: tuple[Probe, ...]
    wall_s: float

    @property
    def resolution_bytes(self) -> int:
        return self.hi_bytes - self.lo_bytes


@dataclass(frozen=True, slots=True)
class Summary:
    found_mib: float
    max_mib: float
    edge_mib: float  # the smallest KV seen dying (or the untested top)
    edge_died: bool
    ratio: float
    launches: int
    tune_wall_s: float
    bisect_launches: int
    bisect_wall_s: float
    undetected_oom: int

    @property
    def ratio_ok(self) -> bool:
        return self.ratio >= TARGET_RATIO

    @property
    def oom_ok(self) -> bool:
        return self.undetected_oom == 0

    @property
    def launches_ok(self) -> bool:
        return self.launches <= TARGET_LAUNCHES

    @property
    def all_ok(self) -> bool:
        return self.ratio_ok and self.oom_ok and self.launches_ok


# --- pure parts -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--card", type=int, default=6, help="the memory budget, GiB (default 6)")
    ap.add_argument("--max-bisect", type=int, default=6,
                    help="at most this many bisection launches (default 6)")
    ap.add_argument("--resolution-mib", type=int, default=8,
                    help="stop bisecting at this gap (default 8 MiB)")
    ap.add_argument("--span-mib", type=int, default=512,
                    help="bisect up to found + this, or the budget when less (default 512 MiB)")
    ap.add_argument("--recheck-found", action="store_true",
                    help="launch the found KV first; if it dies, bisect below it instead")
    ap.add_argument("--tuned", type=Path, default=None,
                    help="reuse this finished `pretuner run --out` folder instead of tuning "
                    "(its wall time is then unknown)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the run and the bisection's logs here (default: a temp folder)")
    args = ap.parse_args(argv)
    if args.max_bisect < 0 or args.resolution_mib < 1 or args.span_mib < args.resolution_mib:
        ap.error("--max-bisect >= 0, --resolution-mib >= 1 and --span-mib >= --resolution-mib")
    return args


def next_probe(lo: int, hi: int, resolution: int) -> int | None:
    """The next KV to try between `lo` (holds) and `hi` (dies), on a whole MiB; None once
    the gap is within `resolution`."""
    if hi - lo <= resolution:
        return None
    mid = lo + (hi - lo) // 2
    mid -= (mid - lo) % MIB  # a whole MiB above lo, as a person would pin it
    return mid if lo < mid < hi else None


def bisect(holds: Callable[[int], Probe], lo: int, hi: int, resolution: int,
           max_launches: int, hi_died: bool = False,
           clock: Callable[[], float] = time.monotonic) -> Bisection:
    """Narrow [lo holds, hi dies] with at most `max_launches` calls of `holds`."""
    t0 = clock()
    probes: list[Probe] = []
    while len(probes) < max_launches and (kv := next_probe(lo, hi, resolution)) is not None:
        p = holds(kv)
        probes.append(p)
        if p.held:
            lo = kv
        else:
            hi, hi_died = kv, True
    return Bisection(lo, hi, hi_died, tuple(probes), clock() - t0)


def with_kv(argv: list[str], kv_bytes: int, port: int) -> list[str]:
    """The validating launch's argv with another pinned KV and port (each flag must be there)."""
    out = list(argv)
    for flag, value in ((KV_FLAG, str(kv_bytes)), ("--port", str(port))):
        if flag not in out or out.index(flag) + 1 >= len(out):
            raise ValueError(f"{flag} with a value is missing from the launch command")
        out[out.index(flag) + 1] = value
    return out


def flag_value(argv: list[str], flag: str) -> str:
    i = argv.index(flag)
    return argv[i + 1]


def summarize(t: Tuned, b: Bisection) -> Summary:
    return Summary(
        found_mib=t.kv_bytes / MIB, max_mib=b.lo_bytes / MIB, edge_mib=b.hi_bytes / MIB,
        edge_died=b.hi_died, ratio=t.kv_bytes / b.lo_bytes if b.lo_bytes else 0.0,
        launches=t.launches, tune_wall_s=t.wall_s, bisect_launches=len(b.probes),
        bisect_wall_s=b.wall_s, undetected_oom=int(t.kv_bytes > b.lo_bytes))


def table(s: Summary) -> list[str]:
    """One table: what, value, target, whether it holds."""
    def ok(flag: bool) -> str:
        return "yes" if flag else "NO"

    edge = (f"{s.edge_mib:,.1f} MiB died" if s.edge_died
            else f"nothing died up to {s.edge_mib:,.1f} MiB: a lower bound")
    wall = f"{s.tune_wall_s:.0f} s" if s.tune_wall_s >= 0 else "unknown (--tuned)"
    rows = [
        ("KV found (validated)", f"{s.found_mib:,.1f} MiB", "", ""),
        ("bisected maximum that holds", f"{s.max_mib:,.1f} MiB "
         f"(resolution {s.edge_mib - s.max_mib:,.1f} MiB; {edge})", "", ""),
        ("found / maximum", f"{s.ratio:.4f}", f">= {TARGET_RATIO}", ok(s.ratio_ok)),
        ("undetected OOM (found > maximum)", str(s.undetected_oom), "0", ok(s.oom_ok)),
        ("tuning launches", str(s.launches), f"<= {TARGET_LAUNCHES}", ok(s.launches_ok)),
        ("tuning wall time", wall, "", ""),
        ("bisection launches / wall time", f"{s.bisect_launches} / {s.bisect_wall_s:.0f} s",
         "", ""),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    head = ("what", "value", "target", "holds")
    w = [max(a, len(h)) for a, h in zip(w, head, strict=True)]
    lines = [" | ".join(h.ljust(n) for h, n in zip(head, w, strict=True)),
             "-+-".join("-" * n for n in w)]
    lines += [" | ".join(c.ljust(n) for c, n in zip(r, w, strict=True)).rstrip() for r in rows]
    return lines


# --- the edges: the tuning run and one real launch ------------------------------------------

def vllm_python() -> str | None:
    """The interpreter with vllm-cpu, as the tuning finds it; None when it is not installed."""
    python = engine_python(ROWS["vllm-cpu"], os.environ, cwd=ROOT)
    if python is None or not Path(python).is_file():
        return None
    found = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                            "sys.exit(u.find_spec('vllm') is None)"],
                           check=False, capture_output=True, timeout=120)
    return python if found.returncode == 0 else None


def tune(out: Path, card: int) -> float:
    """Run `pretuner run` into `out`; its wall time."""
    argv = [sys.executable, "-m", "pretuner", "run", "--model", str(TINY), "--engine",
            "vllm-cpu", "--server-arg", "--load-format dummy", "--card", str(card),
            "--out", str(out), "--json"]
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, check=False, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"pretuner run exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall


def read_tuned(out: Path, wall_s: float) -> Tuned:
    """The validated KV and the launch that proved it, from a finished run's folder."""
    rep = json.loads((out / "report.json").read_text(encoding="utf-8"))
    if not rep["validated"]:
        raise RuntimeError(f"the run in {out} is not validated")
    kv = rep["derivation"]["kv_cache_memory_bytes"]
    step = next(s for s in reversed(rep["steps"])
                if s["outcome"] == "ok" and s["settings"]["kv_cache_bytes"] == kv)
    cmd = json.loads((out / f"launch-{step['n']}" / "command.json").read_text(encoding="utf-8"))
    argv = cmd["argv"]
    bpt = kv_bytes_per_token(resolve(str(TINY)), tp=step["settings"]["tp"],
                             pp=step["settings"]["pp"],
                             kv_dtype=step["settings"]["kv_cache_dtype"])
    return Tuned(kv_bytes=kv, launches=rep["launches"], wall_s=wall_s,
                 budget_bytes=rep["card_gib"] * GIB,
                 settings=LaunchSettings.from_json(step["settings"]),
                 command=LaunchCommand(argv=argv, env=cmd["env"]),
                 served_name=flag_value(argv, "--served-model-name"),
                 host=flag_value(argv, "--host"), bytes_per_token=bpt)


def launch_holds(t: Tuned, kv: int, folder: Path) -> Probe:
    """Start the server with `kv` pinned, exercise it as the validation does, stop it."""
    t0 = time.monotonic()
    port = free_port(t.host)
    base = f"http://{t.host}:{port}"
    log_path = folder / f"kv-{kv}" / "server.log"
    settings = replace(t.settings, kv_cache_bytes=kv)
    ctx = LaunchContext(build=lambda s, p: t.command, served_name=t.served_name, host=t.host,
                        request_timeout_s=REQUEST_TIMEOUT_S)
    print(f"  bisect: {kv / MIB:,.1f} MiB ...", end="", flush=True)
    proc = ServerProcess.start(with_kv(t.command.argv, kv, port),
                               {**os.environ, **t.command.env}, log_path, cwd=ROOT)
    try:
        try:
            proc.wait_ready(f"{base}/health", READY_TIMEOUT_S)
        except ServerFailedError:
            oom = read_log(log_path).oom_text
            return _probe(kv, False, f"not ready (exit {proc.poll()})"
                          + (f": {oom[:120]}" if oom else ""), t0)
        ran = V1Hooks(t.bytes_per_token).exercise(settings, ctx, base, lambda p, d: None,
                                                  log_path)
        alive = proc.poll() is None
        held = ran.total > 0 and ran.ok == ran.total and alive
        oom = None if held else read_log(log_path).oom_text
        why = f"{ran.ok}/{ran.total} requests ok" + ("" if alive else ", server died") \
            + (f" ({ran.error[:80]})" if ran.error else "") + (f": {oom[:120]}" if oom else "")
        return _probe(kv, held, why, t0)
    finally:
        proc.stop(STOP_GRACE_S)


def _probe(kv: int, held: bool, why: str, t0: float) -> Probe:
    p = Probe(kv, held, why, time.monotonic() - t0)
    print(f" {'holds' if held else 'dies'}: {why}, {p.seconds:.0f} s", flush=True)
    return p


def truth(t: Tuned, args: argparse.Namespace, folder: Path) -> Bisection:
    """The bisected maximum, starting from the found KV (proven by the run)."""
    def holds(kv: int) -> Probe:
        return launch_holds(t, kv, folder)

    res, span = args.resolution_mib * MIB, args.span_mib * MIB
    hi = min(t.budget_bytes, t.kv_bytes + span)
    if args.recheck_found and args.max_bisect > 0:
        first = holds(t.kv_bytes)
        if not first.held:  # an undetected OOM: the maximum lies below what was found
            b = bisect(holds, max(0, t.kv_bytes - span), t.kv_bytes, res, args.max_bisect - 1,
                       hi_died=True)
            return replace(b, probes=(first, *b.probes), wall_s=b.wall_s + first.seconds)
        b = bisect(holds, t.kv_bytes, hi, res, args.max_bisect - 1)
        return replace(b, probes=(first, *b.probes), wall_s=b.wall_s + first.seconds)
    return bisect(holds, t.kv_bytes, hi, res, args.max_bisect)


def run(args: argparse.Namespace, work: Path) -> Summary:
    if args.tuned is not None:
        tuned = read_tuned(args.tuned, -1.0)
    else:
        print(f"tuning: pretuner run --engine vllm-cpu --card {args.card} (a few minutes) ...",
              flush=True)
        out = work / "run"
        tuned = read_tuned(out, tune(out, args.card))
    print(f"found {tuned.kv_bytes / MIB:,.1f} MiB in {tuned.launches} launches; bisecting "
          f"with the worst-case load (at most {args.max_bisect} launches)", flush=True)
    return summarize(tuned, truth(tuned, args, work / "bisect"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if vllm_python() is None:
        print("skipped: vllm-cpu is not installed (scripts/install_vllm_cpu.sh, or set "
              "PRETUNER_VLLM_PYTHON)")
        return 0
    t0 = time.monotonic()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        s = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-cpu-") as tmp:
            s = run(args, Path(tmp))
    print()
    print(f"== real vLLM on CPU (vllm-cpu 0.32), tiny Qwen3, --card {args.card} GiB budget ==")
    print("\n".join(table(s)))
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0 if s.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
