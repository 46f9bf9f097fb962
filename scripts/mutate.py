"""Check that the quick tests catch a wrong tuning decision: apply one-line mutants, one at a
time, to a copy of the package and run the quick tier against each.

A mutant is killed when the quick tier fails with it in place, and survives when the quick
tier still passes: each survivor is a decision no fast test protects. The mutants are applied
to a copy of the checkout in a temporary folder (with `../shared` linked beside it), so an
interrupted run never leaves a mutant in the working tree.

    python scripts/mutate.py                 # every mutant, the quick tier (stops at a failure)
    python scripts/mutate.py --list          # the mutants
    python scripts/mutate.py --only watermark --only learn-margin

Exit status: 0 when every mutant was killed, 1 when one survived, 2 when one could not be
applied (its line is gone: update the list) or the unmutated tree already fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["-m", "not slow and not engine", "-x", "-q", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the checkout
    old: str  # must occur exactly once in the file
    new: str
    rule: str  # what the quick tier must protect


MUTANTS = (
    Mutant("verdict-over-cap", "pretuner/tune/r01/validation.py",
           "and peak <= cap_mib\n", "and peak <= cap_mib * 1.1\n",
           "a validation whose peak passed card*util is not validated"),
    Mutant("rank-spread", "pretuner/tune/r01/budget.py",
           "        + rank_spread_bytes(rank_peaks_mib)\n", "",
           "ranks that differ get the spread as headroom"),
    Mutant("learn-margin", "pretuner/tune/r01/config.py",
           "LEARN_MARGIN = 0.10", "LEARN_MARGIN = 0",
           "a validation OOM inflates what its dump showed"),
    Mutant("watermark", "pretuner/method.py",
           "usable = blocks - int(watermark * blocks)", "usable = blocks",
           "vLLM 0.6's block watermark costs exactly its blocks"),
    Mutant("extrapolation-margin", "pretuner/tune/r01/search.py",
           "EXTRAPOLATION_MARGIN = 0.05", "EXTRAPOLATION_MARGIN = 0",
           "a length beyond the measured ones keeps a margin over the line"),
    Mutant("v1-margin-share", "pretuner/pinned.py",
           "MARGIN_SHARE = 0.005", "MARGIN_SHARE = 0.0045",
           "the V1 margin of the real H100 run worked out by hand"),
    Mutant("v1-no-margin", "pretuner/pinned.py",
           "return max(MARGIN_FLOOR_MIB, math.ceil(total_mib * MARGIN_SHARE))", "return 0",
           "a pinned KV stays below the real H100 edge (60 GiB held, 61 died)"),
    Mutant("chunk-threshold-boundary", "pretuner/tune/r01/prerun.py",
           "length > 4 * cfg.chunk_tokens", "length >= 4 * cfg.chunk_tokens",
           "chunked prefill only above 4 chunk steps (8,192 tokens is shortened)"),
    Mutant("chunk-threshold-factor", "pretuner/tune/r01/prerun.py",
           "length > 4 * cfg.chunk_tokens", "length > 5 * cfg.chunk_tokens",
           "chunked prefill above 4 chunk steps (8,448 tokens is chunked)"),
    Mutant("per-seq-fixed", "pretuner/method.py",
           "PER_SEQ_FIXED_BYTES = 4 * MIB", "PER_SEQ_FIXED_BYTES = 2 * MIB",
           "each running sequence adds 3 fp32 vocab rows and 4 MiB"),
    Mutant("kv-factor", "pretuner/kvmath.py",
           "return layers * 2 * local_heads * spec.head_dim * elem",
           "return layers * local_heads * spec.head_dim * elem",
           "K and V both count in the KV bytes per token (hard figures, the emulator's own truth)"),
    Mutant("noise-floor", "pretuner/noise.py",
           "SPREAD_SEEN_MIB = 500", "SPREAD_SEEN_MIB = 0",
           "a proven configuration keeps the boot-noise floor above its peak"),
)


def copy_checkout(dest: Path) -> Path:
    """The checkout (without its venvs, git folder and run records) in `dest/main`, with
    `../shared` linked beside it as CI has it."""
    tree = dest / "main"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache",
        ".pytest_cache", ".hypothesis", "*.egg-info", "build", "dist"))
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (dest / "shared").symlink_to(shared)
    return tree


def run_quick(tree: Path, extra: list[str]) -> tuple[int, float, str, str]:
    """pytest's exit code, the seconds it took, its summary line and the first failed test."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", *QUICK, "-rf", *extra], cwd=tree,
                          env=env, capture_output=True, text=True, check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    failed = next((line.split()[1] for line in lines if line.startswith("FAILED ")), "")
    return proc.returncode, time.monotonic() - started, lines[-1] if lines else "", failed


def apply(tree: Path, m: Mutant) -> str:
    path = tree / m.path
    text = path.read_text(encoding="utf-8")
    if text.count(m.old) != 1:
        raise LookupError(f"{m.path}: {m.old!r} occurs {text.count(m.old)} times, not once")
    path.write_text(text.replace(m.old, m.new), encoding="utf-8")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="a mutant's name (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the check that the unmutated tree passes")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:26} {m.path}: {m.rule}")
        return 0
    unknown = set(args.only) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutant(s): {', '.join(sorted(unknown))}; see --list", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pretuner-mutate-") as tmp:
        tree = copy_checkout(Path(tmp))
        if not args.no_baseline:
            rc, secs, tail, _ = run_quick(tree, args.pytest_args)
            print(f"{'baseline':26} {'passes' if rc == 0 else 'FAILS':9} {secs:6.1f} s  {tail}")
            if rc != 0:
                print("the unmutated tree fails its quick tier: nothing to learn from mutants",
                      file=sys.stderr)
                return 2
        survived, broken = [], []
        for m in chosen:
            try:
                original = apply(tree, m)
            except LookupError as err:
                print(f"{m.name:26} {'MISSING':9}          {err}")
                broken.append(m.name)
                continue
            try:
                rc, secs, tail, failed = run_quick(tree, args.pytest_args)
            finally:
                (tree / m.path).write_text(original, encoding="utf-8")
            # pytest exits 1 when a test failed; with xdist and -x the stop reads as 2
            # ("interrupted") after "N failed" or a collection error.
            killed = rc in (1, 2) and ("failed" in tail or "error" in tail)
            verdict = "SURVIVED" if rc == 0 else "killed" if killed else f"error({rc})"
            print(f"{m.name:26} {verdict:9} {secs:6.1f} s  {m.rule}")
            if failed:
                print(f"{'':26} by {failed}")
            if rc == 0:
                survived.append(m.name)
            elif not killed:
                print(f"{'':26} {tail}")
                broken.append(m.name)
    kills = len(chosen) - len(survived) - len(broken)
    print(f"{kills} of {len(chosen)} mutants killed"
          + (f"; survived: {', '.join(survived)}" if survived else "")
          + (f"; could not run: {', '.join(broken)}" if broken else ""))
    if broken:
        return 2
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
