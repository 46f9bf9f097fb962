"""`nvidia-smi` for the emulated CUDA cards.

A GPU's `memory.used` is the profile's idle reservation + the tenant + every live server's
share as published in the state dir (`pretuner.sim.state`)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

from pretuner.sim.state import DeviceUse, env_int, read_devices, state_dir
from pretuner.sim.v1.memory import CUDA_PROFILES, DEFAULT_CUDA_PROFILE, CudaProfile
from pretuner.stopflag import StopFlag

DRIVER = "580.95.05"
CUDA = "13.0"


def gpus(env: Mapping[str, str]) -> tuple[CudaProfile, list[DeviceUse]]:
    """The CUDA profile (`PRETUNER_SIM_PROFILE`) and its GPUs now, like `npusmi.cards`."""
    p = CUDA_PROFILES.get(env.get("PRETUNER_SIM_PROFILE") or DEFAULT_CUDA_PROFILE,
                          CUDA_PROFILES[DEFAULT_CUDA_PROFILE])
    return p, read_devices(state_dir(env), "cuda", 0, p.gpus_per_node, p.idle_mib,
                           env_int(env, "PRETUNER_SIM_OCCUPIED_MIB"), p.nvml_total_mib)


def query_csv(gpus: Sequence[DeviceUse], profile: CudaProfile, fields: Sequence[str],
              units: bool, header: bool) -> str:
    """`--query-gpu=...` in CSV: index, memory.used, memory.total, memory.free, name."""
    values = {
        "index": lambda g: str(g.index),
        "memory.used": lambda g: f"{g.used_mib}" + (" MiB" if units else ""),
        "memory.total": lambda g: f"{profile.nvml_total_mib}" + (" MiB" if units else ""),
        "memory.free": lambda g: f"{profile.nvml_total_mib - g.used_mib}"
                                 + (" MiB" if units else ""),
        "name": lambda g: profile.gpu_name,
    }
    lines = []
    if header:
        lines.append(", ".join(f + (" [MiB]" if units and f.startswith("memory") else "")
                               for f in fields))
    for g in gpus:
        lines.append(", ".join(values[f](g) for f in fields))
    return "\n".join(lines) + "\n"


def table(gpus: Sequence[DeviceUse], profile: CudaProfile) -> str:
    """The plain `nvidia-smi` table (the memory columns are what a reader parses)."""
    bar = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
    wide = "+" + "-" * 89 + "+"
    lines = [
        dt.datetime.now().strftime("%a %b %d %H:%M:%S %Y"), wide,
        f"| NVIDIA-SMI {DRIVER}".ljust(35) + f"Driver Version: {DRIVER}".ljust(32)
        + f"CUDA Version: {CUDA}".ljust(23) + "|",
        bar,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A "
        "| Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage "
        "| GPU-Util  Compute M. |",
        bar.replace("-", "="),
    ]
    for g in gpus:
        busy = bool(g.processes)
        power = f"{profile.power_w + (220 if busy else 0)}W / {profile.power_cap_w}W"
        mem = f"{g.used_mib}MiB / {profile.nvml_total_mib}MiB"
        lines.append(f"| {g.index:>3}  {profile.gpu_name[:25]:<25}{'On':>9} |"
                     f"   00000000:{0x18 + g.index:02X}:00.0 Off |{'0':>21} |")
        lines.append(f"| N/A   {34 + (8 if busy else 0):>2}C    P0{power:>24} |{mem:>23} |"
                     f"{(35 if busy else 0):>7}%      Default |")
        lines.append(bar)
    lines += ["", wide, "| Processes:".ljust(90) + "|",
              "|  GPU   GI   CI              PID   Type   Process name".ljust(79)
              + "GPU Memory |",
              ("|" + " " * 29 + "ID   ID").ljust(79) + "Usage      |",
              "|" + "=" * 89 + "|"]
    listed = [(g.index, pid, mib) for g in gpus for pid, mib in g.processes]
    for index, pid, mib in listed:
        lines.append(f"|  {index:>3}   N/A  N/A  {pid:>15}      C   {'python3':<36}"
                     f"{mib:>6}MiB |")
    if not listed:
        lines.append("|  No running processes found".ljust(90) + "|")
    lines.append(wide)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`nvidia-smi [--query-gpu=F,... --format=csv[,noheader][,nounits]] [-i N] [-lms N]`;
    with `-lms N` (or `-l N` seconds) the output is printed again every N ms until SIGTERM or
    SIGINT, which end it quietly with 0."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    query, fmt, only, loop_ms = None, "", None, None
    it = iter(args)
    for arg in it:
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if eq and name == "--query-gpu":
            query = value
        elif eq and name == "--format":
            fmt = value
        elif name in ("-i", "--id"):
            only = value if eq else next(it, None)
        elif name in ("-lms", "--loop-ms", "-l", "--loop"):  # milliseconds, or seconds
            count = value if eq else next(it, None)
            if count is None or not count.strip().isdigit() or int(count) < 1:
                sys.stderr.write(f"{name} needs a positive whole number.\n")
                return 2
            loop_ms = int(count) * (1 if name in ("-lms", "--loop-ms") else 1000)
        elif arg in ("-h", "--help"):
            sys.stdout.write("usage: nvidia-smi [--query-gpu=index,memory.used,memory.total "
                             "--format=csv,noheader,nounits] [-lms MS]  "
                             "(emulated; figures simulated)\n")
            return 0
    wanted = None if only is None else {int(x) for x in only.split(",") if x.strip().isdigit()}
    fields = [] if query is None else [f.strip() for f in query.split(",") if f.strip()]
    known = ("index", "memory.used", "memory.total", "memory.free", "name")
    bad = [f for f in fields if f not in known]
    if query is not None and (bad or "csv" not in fmt):
        sys.stderr.write(f'Field "{bad[0]}" is not a valid field to query.\n' if bad else
                         "Only --format=csv is supported by the emulated nvidia-smi.\n")
        return 2
    opts = {o.strip() for o in fmt.split(",")}

    def output() -> str:
        profile, shown = gpus(env)
        shown = [g for g in shown if wanted is None or g.index in wanted]
        if query is None:
            return table(shown, profile)
        return query_csv(shown, profile, fields, "nounits" not in opts, "noheader" not in opts)

    if loop_ms is None:
        sys.stdout.write(output())
        return 0
    return _loop(output, loop_ms)


def _loop(output: Callable[[], str], loop_ms: int) -> int:
    """Print `output()` every `loop_ms` until SIGTERM/SIGINT (0) or a reader that went away."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = StopFlag()
    stop.install()
    try:
        while not stop.is_set():
            sys.stdout.write(output())
            sys.stdout.flush()
            stop.wait(loop_ms / 1000)
        return 0
    except BrokenPipeError:
        # Nobody reads any more: stop, and keep the interpreter's final flush from failing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
