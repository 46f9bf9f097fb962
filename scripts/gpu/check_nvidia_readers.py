"""Check pretuner's two NVIDIA readers on a real GPU against a known allocation ramp.

A child process (torch) allocates four 2 GiB steps held 1 s each (+8 GiB), then a 4 GiB spike
held only 60 ms (+12 GiB), then frees it all. NVML (`NvmlReader`) and the streaming
`nvidia-smi -lms 20` reader (`NvidiaSmiStreamReader`) are sampled every 20 ms meanwhile; each
should see the spike: a peak 12 GiB (12,288 MiB, plus the CUDA context) above its idle baseline.
Prints one JSON object. Run on the GPU machine from the repository root:

    PYTHONPATH=$PWD python3 scripts/gpu/check_nvidia_readers.py

Seen on an H200 (2026-11-26): NVML baseline 615 MiB, peak +12,816 MiB over 709 samples;
nvidia-smi baseline 0 MiB, peak +12,817 MiB over 703 samples.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

from pretuner.devices.base import DeviceReader
from pretuner.devices.nvidia import NvidiaSmiStreamReader, NvmlReader, load_nvml

CHILD = r"""
import time, torch
torch.empty(1, device="cuda"); torch.cuda.synchronize(); time.sleep(1.5)
held = []
for _ in range(4):
    held.append(torch.empty(2 << 30, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize(); time.sleep(1.0)
spike = torch.empty(4 << 30, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
time.sleep(0.06); del spike; torch.cuda.synchronize(); torch.cuda.empty_cache(); time.sleep(1.0)
"""


def sample_until(reader: DeviceReader, stop: threading.Event,
                 into: list[tuple[float, int, int]]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        if (s := reader.sample()) is not None:
            into.append((t, s.worst_used_mib, s.devices[0].total_mib))
        time.sleep(max(0.0, 0.02 - (time.monotonic() - t)))


def summary(points: list[tuple[float, int, int]]) -> dict[str, Any]:
    if not points:
        return {"samples": 0}
    base = min(p[1] for p in points[:10])
    peak = max(p[1] for p in points)
    return {"samples": len(points), "span_s": round(points[-1][0] - points[0][0], 2),
            "baseline_mib": base, "peak_mib": peak, "peak_minus_baseline_mib": peak - base,
            "total_mib": points[0][2]}


def main() -> None:
    nvml = load_nvml()
    stream = NvidiaSmiStreamReader("nvidia-smi")
    readers: dict[str, DeviceReader] = {"nvidia-smi": stream}
    if nvml is not None:
        readers["nvml"] = NvmlReader(nvml)
    series: dict[str, list[tuple[float, int, int]]] = {name: [] for name in readers}
    stop = threading.Event()
    threads = [threading.Thread(target=sample_until, args=(r, stop, series[n]), daemon=True)
               for n, r in readers.items()]
    for th in threads:
        th.start()
    time.sleep(1.0)
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                           check=False)
    time.sleep(0.5)
    stop.set()
    for th in threads:
        th.join(5)
    stream.close()
    out: dict[str, Any] = {"child_rc": child.returncode, "child_stderr": child.stderr[-500:]}
    out.update({name: summary(points) for name, points in series.items()})
    sys.stdout.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
