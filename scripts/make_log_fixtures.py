"""Record real MindSpore (CPU) logs and trim them into the scanner's test fixtures.

Runs a small MindSpore program with GLOG_v=1 three ways: at exit (pool dump to stderr), with
GLOG_logtostderr=0 GLOG_log_dir=D RANK_ID=N (the per-rank folder layout), and under an
address-space limit (RLIMIT_AS) so that a large allocation fails with MindSpore's real OOM
text. The noise is trimmed; target lines, their neighbours and every prefix stay verbatim.

    python scripts/make_log_fixtures.py [--out tests/fixtures/logs]

With `--from-run RUN_DIR --name NAME` it trims instead the server logs of a `pretuner run`
record (the mindspore-cpu backend's): `NAME-launch-<n>.log` per launch. There every line the
server itself wrote (vLLM-format lines, tracebacks) stays, and MindSpore's own `[LEVEL] ...`
lines are trimmed as above.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pretuner.logscan.lines import ANCHORS

PROGRAM = r"""
import resource, sys
import numpy as np
import mindspore as ms
from mindspore import nn, Tensor

ms.set_context(mode=ms.GRAPH_MODE if sys.argv[2] == "graph" else ms.PYNATIVE_MODE)
ms.set_device("CPU")
rows = int(sys.argv[1])
net = nn.SequentialCell(nn.Dense(256, 1024), nn.ReLU(), nn.Dense(1024, 256))
x = Tensor(np.ones((rows, 256), np.float32))
if sys.argv[3] == "oom":
    # Room for what is mapped now plus 2 GiB: the 6 GB activation of `rows` cannot fit.
    with open("/proc/self/status") as status:
        vm_kib = next(int(l.split()[1]) for l in status if l.startswith("VmSize:"))
    limit = (vm_kib << 10) + (2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    print("sum", float(net(x).sum()))
except Exception as err:  # the OOM surfaces as a RuntimeError
    print("failed:", type(err).__name__)
"""

CONTEXT = 2  # lines kept around each target line
HEAD = 4  # first lines kept (the GLOG file header, the first prefixes)
EXTRA = (b"Common mem pool info", b"Allocate memory failed", b"malloc memory failed")


def trim(data: bytes) -> bytes:
    """Keep the head, every target line and a little context; mark each cut."""
    lines = data.splitlines(keepends=True)
    keep = set(range(min(HEAD, len(lines))))
    for i, line in enumerate(lines):
        if any(a in line for a in ANCHORS + EXTRA):
            keep.update(range(max(0, i - CONTEXT), min(len(lines), i + CONTEXT + 1)))
    return b"".join(lines[i] for i in sorted(keep))


def trim_server_log(data: bytes) -> bytes:
    """The server's own lines all stay; MindSpore's prefixed lines are trimmed like `trim`."""
    lines = data.splitlines(keepends=True)
    keep = set(range(min(HEAD, len(lines))))
    for i, line in enumerate(lines):
        if not line.startswith(b"["):
            keep.add(i)
        elif any(a in line for a in ANCHORS + EXTRA):
            keep.update(range(max(0, i - CONTEXT), min(len(lines), i + CONTEXT + 1)))
    return b"".join(lines[i] for i in sorted(keep))


def from_run(run_dir: Path, name: str, out: Path) -> None:
    logs = sorted(run_dir.glob("launch-*/server.log"))
    if not logs:
        raise SystemExit(f"no launch-*/server.log under {run_dir}")
    out.mkdir(parents=True, exist_ok=True)
    for log in logs:
        target = out / f"{name}-{log.parent.name}.log"
        target.write_bytes(trim_server_log(log.read_bytes()))
        print(f"{target} ({target.stat().st_size:,} bytes)")


def run(script: Path, args: list[str], env: dict[str, str]) -> bytes:
    full = {**os.environ, "GLOG_v": "1", **env}
    done = subprocess.run(
        [sys.executable, str(script), *args], env=full, capture_output=True, timeout=600
    )
    return done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/logs"))
    parser.add_argument("--from-run", type=Path, default=None, help="a pretuner run record")
    parser.add_argument("--name", default="mscpu", help="file prefix with --from-run")
    args = parser.parse_args()
    out: Path = args.out
    if args.from_run is not None:
        from_run(args.from_run, args.name, out)
        return
    import mindspore  # noqa: PLC0415  (only this script needs it)

    version = mindspore.__version__
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "mlp.py"
        script.write_text(PROGRAM)
        exit_log = run(script, ["65536", "pynative", "exit"], {})
        (out / "ms_cpu_exit.log").write_bytes(trim(exit_log))
        oom_log = run(script, ["1500000", "graph", "oom"], {})
        (out / "ms_cpu_oom.log").write_bytes(trim(oom_log))
        glog_dir = Path(tmp) / "glog"
        for rank, rows in ((0, 16384), (1, 65536)):
            env = {"GLOG_logtostderr": "0", "GLOG_log_dir": str(glog_dir), "RANK_ID": str(rank)}
            run(script, [str(rows), "pynative", "exit"], env)
        target = out / "ms_rank_dir"
        shutil.rmtree(target, ignore_errors=True)
        for src in sorted(glog_dir.rglob("*")):
            dst = target / src.relative_to(glog_dir)
            if src.is_symlink():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(os.readlink(src))
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(trim(src.read_bytes()))
    print(f"fixtures written to {out} with MindSpore {version}")


if __name__ == "__main__":
    main()
