"""Benchmark `pretuner scan` against `grep -F -c 'actual peak used'` on a >= 1 GiB GLOG log.

Writes a realistic MindSpore GLOG_v=1 log (INFO noise in the real prefix format from several
ranks, a few dozen memory lines spread through it), then, warm cache, in the same run and
interleaved, `--runs` times each (medians):

  grep           `grep -F -c 'actual peak used' LOG`: the baseline;
  pretuner scan  `python -m pretuner scan --json LOG`: the whole command as a user runs it
                 (interpreter start, CLI imports, scan, JSON output);
  library        a fresh interpreter running `from pretuner.logscan import scan_paths` and the
                 scan call, the import and the call timed apart;
  CLI start      `python -m pretuner scan --help`: what start-up and CLI imports cost alone.

Every time is from spawn to exit as seen by this script (the call: inside the child). The
ratio is grep's time over the scanner's: 1.00 or more is at least grep's throughput. It checks
that both scanner commands extracted every planted line in every run, and prints the peak RSS
of each (wait4: the largest single process, workers included). The file is removed at the end.

    python scripts/bench_logscan.py [--gib 1.0] [--runs 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Bodies of real MindSpore 2.10 INFO lines (recorded on CPU), used as the noise.
NOISE = [
    (
        "COMMON",
        "mindspore/ccsrc/pybind_api/frontend/manager.cc:141",
        "ClearResPart2",
        "Start clear ConfigManager...",
    ),
    (
        "ME",
        "mindspore/ccsrc/runtime/hardware_abstract/device_context/device_context_manager.cc:201",
        "LoadDynamicLib",
        "Load dynamic library: libmindspore_ascend.so.2 failed. libge_runner.so: cannot "
        "open shared object file: No such file or directory",
    ),
    (
        "PRE_ACT",
        "mindspore/ccsrc/runtime/memory/mem_pool/mem_dynamic_allocator.cc:161",
        "Initialize",
        "Skip initialization of memory pool since init size is not configured.",
    ),
    (
        "DEVICE",
        "mindspore/ccsrc/plugin/cpu/res_manager/mem_manager/cpu_memory_pool.cc:81",
        "AllocDeviceMem",
        "Current alloc size[1073741824], total used size[1073741824].",
    ),
    (
        "RUNTIME_FRAMEWORK",
        "mindspore/ccsrc/backend/ms_backend/runtime/actors/base/kernel_actor.cc:983",
        "OnMemoryAllocFinish",
        "Kernel launch finished for kernel: Default/0-Dense/MatMul-op0",
    ),
    (
        "PIPELINE",
        "mindspore/ccsrc/frontend/jit/ps/executor/graph_executor_py.cc:210",
        "ClearRes",
        "Clean Graph executor resource!",
    ),
    (
        "CORE",
        "mindspore/core/utils/ms_context.cc:316",
        "SetDeviceTargetFromInner",
        "Set memory_optimize_level to O0 as default on other device",
    ),
    (
        "DEBUG",
        "mindspore/ccsrc/frontend/jit/ps/debug/trace.cc:673",
        "GetEvalStackInfo",
        "Get graph analysis information begin",
    ),
    (
        "COMMON",
        "mindspore/ccsrc/utils/utils.cc:288",
        "GetSystemMemorySize",
        "Get system memory(MemAvailable): 24072724 kB",
    ),
    (
        "PRE_ACT",
        "mindspore/ccsrc/runtime/memory/mem_pool/mem_dynamic_allocator.cc:218",
        "AllocTensorMem",
        "Alloc tensor mem for kernel output, size: 4194304, stream id: 0",
    ),
    (
        "ME",
        "mindspore/core/mindrt/src/actor/actormgr.cc:165",
        "Finalize",
        "mindrt Actors finish exiting.",
    ),
    (
        "RUNTIME_FRAMEWORK",
        "mindspore/ccsrc/runtime/pipeline/async_rqueue.cc:136",
        "WorkerLoop",
        "Run task finished, queue size: 0",
    ),
]
DUMP = (
    "The dynamic memory pool total allocated mem:{alloc}M, min addr :0, max addr: 0, peak used "
    "mem:{peak}M, actual peak used mem:{actual}M, in used mem:390M, total used by event mem:0M, "
    "total idle mem:4729M, total eager free mem:0M. Weight used size:0M, constant value used "
    "size:0M, kernel output used size:0M, other used size:390M."
)
INIT = (
    "Device MOC Size:65536M, Device free MOC Size:62345M, Reserved MOC size for Other Components"
    "(HCCL/rts/etc.):3072M, User define MindSpore MOC Size:57G, MindSpore Used MOC Size:58368M."
)
OOM = (
    "#umsg#Memory not enough:#umsg#Device(id:0) memory isn't enough and alloc failed, kernel "
    "name: Default/FlashAttention-op12, alloc size: 2147483648B."
)
RANKS = 8


def prefix(level: str, module: str, pid: int, stamp: str, where: str, func: str) -> str:
    return f"[{level}] {module}({pid},7f44c3888b80,python):{stamp} [{where}] {func}] "


@dataclass(frozen=True, slots=True)
class Expected:
    """What the scanner must extract from the generated log."""

    ranks: int
    worst_mib: int
    oom: int
    card_mib: int
    kv_cache_tokens: int
    planted_lines: int

    def check(self, found: dict[str, object]) -> dict[str, bool]:
        """Each figure of a `pretuner scan --json` document: extracted right or not."""
        ranks, oom = found.get("ranks"), found.get("oom")
        return {
            "ranks": isinstance(ranks, list) and len(ranks) == self.ranks,
            "worst": found.get("worst_actual_peak_mib") == self.worst_mib,
            "oom": isinstance(oom, list) and len(oom) == self.oom,
            "card_mib": found.get("card_mib") == self.card_mib,
            "kv_cache_tokens": found.get("kv_cache_tokens") == self.kv_cache_tokens,
        }


def write_log(path: Path, size: int, rng: random.Random) -> Expected:
    """Write the log; returns what the scanner must find."""
    pids = [4000 + 17 * r for r in range(RANKS)]
    pool = []
    for i in range(60_000):
        module, where, func, text = rng.choice(NOISE)
        stamp = f"2025-05-16-23:{i // 6000 % 60:02d}:{i % 60:02d}.{i % 1000:03d}.{i * 7 % 1000:03d}"
        pool.append(prefix("INFO", module, rng.choice(pids), stamp, where, func) + text + "\n")
    block = "".join(pool).encode()
    blocks = max(1, -(-size // len(block)))  # at least `size` bytes
    peaks = {pid: 20_000 + 1_000 * r for r, pid in enumerate(pids)}
    targets: list[tuple[int, str]] = []
    for pid in pids:
        at = "2025-05-16-23:00:00.000.000"
        targets.append(
            (
                0,
                prefix("INFO", "DEVICE", pid, at, "ascend_memory_adapter.cc:99", "Initialize")
                + INIT,
            )
        )
        for k in range(3):  # smaller dumps earlier, the real peak later
            actual = peaks[pid] - 500 * (2 - k)
            text = DUMP.format(alloc=actual + 512, peak=actual - 300, actual=actual)
            where = "mem_dynamic_allocator.cc:1211"
            line = prefix("INFO", "PRE_ACT", pid, at, where, "DumpDynamicMemPoolStateInfo") + text
            targets.append((rng.randrange(blocks), line))
    oom_pid = pids[3]
    targets.append(
        (
            blocks // 2,
            prefix(
                "ERROR",
                "RUNTIME_FRAMEWORK",
                oom_pid,
                "2025",
                "memory_manager_actor.cc:515",
                "SetOpContextMemoryAllocFail",
            )
            + OOM,
        )
    )
    targets.append(
        (blocks - 1, "INFO 05-16 23:06:54 [kv_cache_utils.py:1] GPU KV cache size: 645,120 tokens")
    )
    targets.append(
        (blocks - 1, "INFO 05-16 23:06:54 [gpu_worker.py:1] Available KV cache memory: 44.30 GiB")
    )
    by_block: dict[int, list[str]] = {}
    for index, line in targets:
        by_block.setdefault(index, []).append(line + "\n")
    with path.open("wb") as out:
        for index in range(blocks):
            out.write(block)
            for line in by_block.get(index, []):
                out.write(line.encode())
    return Expected(
        ranks=RANKS,
        worst_mib=max(peaks.values()),
        oom=1,
        card_mib=65536,
        kv_cache_tokens=645120,
        planted_lines=len(targets),
    )


LIBRARY = r"""
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from pretuner.logscan import scan_paths
t1 = time.perf_counter()
result = scan_paths([Path(sys.argv[1])])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "scan_s": t2 - t1, "result": result.to_json()}))
"""


@dataclass(frozen=True, slots=True)
class ProcessRun:
    """One child process: spawn to exit, its own peak RSS, what it printed."""

    wall_s: float
    peak_rss_mib: float
    exit_code: int
    stdout: bytes


# The commands run with Python's bytecode cache, as on a user's machine (the warm-up run writes
# it), even where the shell that starts the benchmark turns it off.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_process(argv: Sequence[str]) -> ProcessRun:
    """Run argv to its end, its stdout to a file; the RSS is that child's alone (wait4)."""
    with tempfile.TemporaryFile() as out:
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out.fileno(), 1),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
        ]
        start = time.perf_counter()
        pid = os.posix_spawn(argv[0], list(argv), CHILD_ENV, file_actions=actions)
        _, status, usage = os.wait4(pid, 0)
        wall_s = time.perf_counter() - start
        out.seek(0)
        return ProcessRun(
            wall_s, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), out.read()
        )


@dataclass
class Series:
    """The runs of one command."""

    runs: list[ProcessRun]

    @property
    def median_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def peak_rss_mib(self) -> float:
        return max(r.peak_rss_mib for r in self.runs)


@dataclass(frozen=True, slots=True)
class Commands:
    """The argv of each measured command."""

    grep: list[str]
    cli: list[str]
    library: list[str]
    cli_start: list[str]


def commands(log: Path) -> Commands:
    grep = [_which("grep"), "-F", "-c", "actual peak used", str(log)]
    cli = [sys.executable, "-m", "pretuner", "scan", "--json", str(log)]
    library = [sys.executable, "-c", LIBRARY, str(log)]
    cli_start = [sys.executable, "-m", "pretuner", "scan", "--help"]
    return Commands(grep, cli, library, cli_start)


def _which(name: str) -> str:
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        found = Path(folder) / name
        if os.access(found, os.X_OK):
            return str(found)
    sys.exit(f"{name} not found on PATH")


def measure(cmds: Commands, runs: int) -> dict[str, Series]:
    """Every command `runs` times, interleaved: a slow spell of the machine hits all alike."""
    names = ("grep", "cli", "library", "cli_start")
    for name in names:  # warm the page cache and the interpreter's files
        run_process(getattr(cmds, name))
    series = {name: Series([]) for name in names}
    for _ in range(runs):
        for name in names:
            series[name].runs.append(run_process(getattr(cmds, name)))
    return series


def library_times(series: Series) -> tuple[float, float]:
    """Median import and scan-call seconds inside the library child."""
    docs = [json.loads(r.stdout) for r in series.runs]
    return (
        statistics.median(float(d["import_s"]) for d in docs),
        statistics.median(float(d["scan_s"]) for d in docs),
    )


def report(series: dict[str, Series], expect: Expected, size: int, runs: int) -> bool:
    """Print the figures; True when every planted figure was extracted by both processes."""
    gib = size / 2**30
    grep_s = series["grep"].median_s
    cli, library = series["cli"], series["library"]
    import_s, scan_s = library_times(library)

    def line(label: str, seconds: float, rss_mib: float | None = None) -> str:
        rss = f"   peak RSS {rss_mib:6.1f} MiB" if rss_mib is not None else ""
        return (
            f"{label:<36} {seconds:7.3f} s  {gib / seconds:5.2f} GiB/s  "
            f"ratio {grep_s / seconds:4.2f}{rss}"
        )

    print(
        f"machine: {os.cpu_count()} CPU(s), Python {sys.version.split()[0]}; log {gib:.2f} GiB, "
        f"{expect.planted_lines} planted lines, {expect.ranks} ranks; warm cache, median of {runs}"
    )
    print("ratio = grep's time / the scanner's: 1.00 or more is at least grep's throughput")
    print("peak RSS = the largest single process of the command (a scan worker or its parent)")
    print(f"{'grep -F -c (baseline)':<36} {grep_s:7.3f} s  {gib / grep_s:5.2f} GiB/s")
    print(line("pretuner scan --json (whole process)", cli.median_s, cli.peak_rss_mib))
    print(line("library in a fresh interpreter", library.median_s, library.peak_rss_mib))
    print(line("  of which the scan_paths call", scan_s))
    print(f"  of which `from pretuner.logscan import scan_paths`: {import_s:.3f} s")
    print(
        f"  `pretuner scan --help` (start-up and CLI imports alone): "
        f"{series['cli_start'].median_s:.3f} s"
    )
    verdicts = {
        "pretuner scan": grep_s / cli.median_s,
        "library process": grep_s / library.median_s,
        "scan call": grep_s / scan_s,
    }
    print(
        "at least grep's throughput: "
        + ", ".join(
            f"{name} {'yes' if ratio >= 1.0 else 'no'} ({ratio:.2f})"
            for name, ratio in verdicts.items()
        )
    )
    ok = True
    for name, runs_of in (("pretuner scan", cli), ("library", library)):
        checks = dict.fromkeys(("exit code 0", *expect.check({})), True)
        for run in runs_of.runs:  # every run, not the last alone
            if run.exit_code != 0:
                checks["exit code 0"] = False
                continue
            doc = json.loads(run.stdout)
            for key, right in expect.check(doc if runs_of is cli else doc["result"]).items():
                checks[key] = checks[key] and right
        ok = ok and all(checks.values())
        print(
            f"extracted ({name}, {len(runs_of.runs)} runs): "
            + ", ".join(f"{k} {'ok' if v else 'WRONG'}" for k, v in checks.items())
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gib", type=float, default=1.0, help="log size in GiB (>= 1 for the claim)"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the log")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "mindspore.bench.log"
        t = time.perf_counter()
        expect = write_log(path, int(args.gib * 2**30), random.Random(7))
        size = path.stat().st_size
        print(f"wrote {size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
        os.sync()  # no writeback of the fresh log while the commands are timed
        series = measure(commands(path), args.runs)
        if not report(series, expect, size, args.runs):
            sys.exit(1)


if __name__ == "__main__":
    main()
