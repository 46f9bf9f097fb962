"""Benchmark the log scanner against `grep -F -c 'actual peak used'` on a >= 1 GiB GLOG log.

Writes a realistic MindSpore GLOG_v=1 log (INFO noise in the real prefix format from several
ranks, a few dozen memory lines spread through it), then, warm cache, times the scanner and
grep (median of several runs each), checks that the scanner extracted every planted line, and
prints the throughput ratio and the scanner's peak RSS. The file is removed at the end.

    python scripts/bench_logscan.py [--gib 1.0] [--runs 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def write_log(path: Path, size: int, rng: random.Random) -> dict[str, object]:
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
    return {
        "ranks": RANKS,
        "worst": max(peaks.values()),
        "oom": 1,
        "card_mib": 65536,
        "kv_cache_tokens": 645120,
        "targets": len(targets),
    }


CHILD = r"""
import json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
from pretuner.logscan import scan_paths
t1 = time.perf_counter()
result = scan_paths([Path(sys.argv[1])])
t2 = time.perf_counter()
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
          resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"import_s": t1 - t0, "scan_s": t2 - t1, "rss_kib": rss,
                  "result": result.to_json()}))
"""


def run_scanner(path: Path) -> dict[str, Any]:  # the child's JSON, with process_s
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True
    )
    report: dict[str, Any] = json.loads(done.stdout)
    report["process_s"] = time.perf_counter() - start
    return report


def run_grep(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["grep", "-F", "-c", "actual peak used", str(path)], capture_output=True)
    return time.perf_counter() - start


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
        print(
            f"wrote {size / 2**30:.2f} GiB ({expect['targets']} target lines, {RANKS} ranks) "
            f"in {time.perf_counter() - t:.1f} s"
        )
        run_grep(path)  # warm the page cache
        run_scanner(path)
        greps, scans, procs, rss = [], [], [], []
        last: dict[str, Any] = {}
        for _ in range(args.runs):
            greps.append(run_grep(path))
            last = run_scanner(path)
            scans.append(float(last["scan_s"]))
            procs.append(float(last["process_s"]))
            rss.append(int(last["rss_kib"]))
        found = last["result"]
        if not isinstance(found, dict):
            sys.exit("the scanner printed no result")
        checks = {
            "ranks": len(found["ranks"]) == expect["ranks"],
            "worst": found["worst_actual_peak_mib"] == expect["worst"],
            "oom": len(found["oom"]) == expect["oom"],
            "card_mib": found.get("card_mib") == expect["card_mib"],
            "kv_cache_tokens": found.get("kv_cache_tokens") == expect["kv_cache_tokens"],
        }
        grep_s, scan_s, proc_s = (statistics.median(x) for x in (greps, scans, procs))
        gib = size / 2**30
        print(f"machine: {os.cpu_count()} CPU(s), Python {sys.version.split()[0]}")
        print(f"grep -F -c      : {grep_s:.3f} s  ({gib / grep_s:.2f} GiB/s)")
        print(f"scanner (scan)  : {scan_s:.3f} s  ({gib / scan_s:.2f} GiB/s)")
        print(f"scanner (process, with interpreter start and imports): {proc_s:.3f} s")
        print(
            f"ratio scanner/grep throughput: {grep_s / scan_s:.2f} (scan call), "
            f"{grep_s / proc_s:.2f} (whole process)"
        )
        print(f"scanner peak RSS: {max(rss) / 1024:.1f} MiB (largest process of the scan)")
        print("extracted: " + ", ".join(f"{k} {'ok' if v else 'WRONG'}" for k, v in checks.items()))
        if not all(checks.values()):
            sys.exit(1)


if __name__ == "__main__":
    main()
