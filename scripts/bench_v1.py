"""Benchmark the V1 method (pinned `--kv-cache-memory-bytes`) on the emulated CUDA cards.

1. The headline: emulated H100 80 GB, Qwen3-8B, max_model_len 32768 (the real runs of
   `../shared/real-logs/vllm-0.24-h100`): the pinned KV validated, its KV tokens against what
   vLLM's own profiling at util 0.9 gives on the same card (the baseline, measured in the same
   run: the pre-run's own log), launches, and whether the validated KV truly fits (the
   emulator's truth: `pretuner.sim.v1.truth`), i.e. no OOM left undetected.
2. Every built-in model on 24, 32, 64 and 80 GB emulated cards (TP as plan chooses it,
   several seeds): KV found / the largest pinned KV that truly survives start-up and the
   worst-case load (median, min), launches (mean, max), and beside it util 0.9's KV / truth
   (0 where vLLM's default does not even start: "util0.9 dies"). Layouts that need more than
   one 8-device node are counted apart ("multi-node": not a V1 target yet).

Every run is the whole V1 loop against the emulated V1 server run in this process
(`pretuner.sim.executor.tune_v1_in_process`: same command line, boot, memory accounting,
log lines and judge as a real run, no processes).

    python scripts/bench_v1.py [--seeds 3] [--cards 24,32,64,80] [--models a,b] [--length 16384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from pretuner.errors import PretunerError
from pretuner.models import builtin_specs, resolve
from pretuner.sim.executor import tune_v1_in_process
from pretuner.sim.plugin import V1_CARDS as SIM_PROFILES
from pretuner.sim.v1.truth import Images, max_kv_bytes, util_outcome
from pretuner.tune.entry import RunOptions
from pretuner.tune.pinned.loop import V1Result
from pretuner.tune.pinned.setup import DEFAULT_SOAK
from pretuner.units import GIB

HEADLINE_MODEL = "qwen3-8b"
HEADLINE_LEN = 32768
LOW = 0.93  # runs below this KV/truth are listed
REAL_UTIL_090_TOKENS = 398_992  # vLLM 0.24 on the real H100 at util 0.9 (README there)


class Shape(TypedDict):
    """A run's server shape, as max_kv_bytes and util_outcome take it by keyword."""

    seed: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    tp: int
    kv_cache_dtype: str


@dataclass(frozen=True)
class Row:
    model: str
    card: int
    seed: int
    ratio: float | None  # KV found / truth
    util_ratio: float | None  # util 0.9's KV / truth
    launches: int
    fits: bool  # the validated KV is at or below the truth
    error: str | None = None
    skipped: bool = False  # the layout needs more than one node (not a V1 target yet)


def _opts(model: str, card: int, seed: int, length: int) -> RunOptions:
    spec = resolve(model)
    length = min(length, spec.max_position_embeddings or length)
    return RunOptions(model=model, engine="vllm", card_gib=card, seed=seed, max_model_len=length)


def _truth(model: str, r: V1Result, card: int, seed: int) -> tuple[int, int]:
    """(the largest pinned KV that truly survives, util 0.9's profiled KV) for the run's shape."""
    f = r.final
    args: Shape = {"seed": seed, "max_model_len": f.max_model_len,
                   "max_num_seqs": f.max_num_seqs,
                   "max_num_batched_tokens": f.max_num_batched_tokens,
                   "block_size": f.block_size, "tp": f.tp, "kv_cache_dtype": f.kv_cache_dtype}
    spec = resolve(model)
    # A vision-language model is tuned for its image worst case and the default soak after it:
    # its truth is the one for that load, not for text requests alone.
    images = Images(None, DEFAULT_SOAK, seed) if spec.vision is not None else None
    return (max_kv_bytes(spec, SIM_PROFILES[card], images=images, **args),
            util_outcome(spec, SIM_PROFILES[card], util=0.9,
                         extra_args=images.argv() if images else (), load=False, **args)[0])


def run_one(model: str, card: int, seed: int, length: int, work: Path) -> Row:
    try:
        r = tune_v1_in_process(_opts(model, card, seed, length), work)
    except PretunerError as err:
        multi = "node(s)" in err.message
        return Row(model, card, seed, None, None, 0, True, f"{type(err).__name__}: {err.message}",
                   skipped=multi)
    truth, util = _truth(model, r, card, seed)
    kv = r.final.kv_cache_bytes or 0
    return Row(model, card, seed, kv / truth if truth else None,
               util / truth if truth else None, len(r.outcomes), kv <= truth)


def headline(work: Path) -> bool:
    """The H100 run; True when every target holds."""
    r = tune_v1_in_process(_opts(HEADLINE_MODEL, 80, 0, HEADLINE_LEN), work / "headline")
    truth, _ = _truth(HEADLINE_MODEL, r, 80, 0)
    kv = r.final.kv_cache_bytes or 0
    base = r.profiled_kv_tokens or 0
    gain = (r.kv_tokens or 0) / base if base else 0.0
    print("== emulated H100 80 GB, Qwen3-8B, max_model_len 32,768 (seed 0) ==")
    print(f"pinned KV validated: {kv / GIB:.2f} GiB ({kv:,} B), {r.kv_tokens or 0:,} KV tokens, "
          f"{len(r.outcomes)} launches, validated={r.validated}")
    print(f"baseline, the engine's own profiling at util 0.9 (this run's pre-run): {base:,} "
          f"tokens (the real H100: {REAL_UTIL_090_TOKENS:,}); ratio {gain:.3f} (target >= 1.08)")
    print(f"truth (largest pinned KV that survives start-up and the worst case): "
          f"{truth / GIB:.2f} GiB; validated KV fits: {kv <= truth}; "
          f"{(truth - kv) / truth:.2%} below it")
    return r.validated and kv <= truth and gain >= 1.08 and len(r.outcomes) <= 3 \
        and kv >= 59 * GIB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cards", default="24,32,64,80")
    ap.add_argument("--models", default="")
    ap.add_argument("--length", type=int, default=16384)
    args = ap.parse_args(argv)
    cards = [int(c) for c in args.cards.split(",")]
    models = [m for m in args.models.split(",") if m] or [
        s.name for s in builtin_specs() if not s.eager_attention]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        failed = 0 if headline(work) else 1
        print()
        print(f"== every model, max_model_len {args.length:,} (or the model's limit), "
              f"{args.seeds} seeds ==")
        print(f"{'card':>5} {'runs':>5} {'KV/truth med':>13} {'min':>6} {'util0.9/truth med':>18} "
              f"{'min':>6} {'launches mean':>14} {'max':>4} {'over truth':>10} {'errors':>7} "
              f"{'multi-node':>10} {'util0.9 dies':>12}")
        for card in cards:
            rows = [run_one(m, card, seed, args.length, work / f"{m}-{card}-{seed}")
                    for m in models for seed in range(args.seeds)]
            ok = [r for r in rows if r.ratio is not None]
            skipped = [r for r in rows if r.skipped]
            over = sum(not r.fits for r in rows)
            failed += over
            ratios = [r.ratio for r in ok if r.ratio is not None]
            utils = [r.util_ratio for r in ok if r.util_ratio is not None]
            launches = [r.launches for r in ok]
            print(f"{card:>5} {len(rows):>5} {_med(ratios):>13} {_min(ratios):>6} "
                  f"{_med(utils):>18} {_min(utils):>6} "
                  f"{statistics.mean(launches) if launches else 0:>14.2f} "
                  f"{max(launches, default=0):>4} {over:>10} "
                  f"{len(rows) - len(ok) - len(skipped):>7} {len(skipped):>10} "
                  f"{sum(u == 0 for u in utils):>12}")
            for r in rows:
                if r.error and not r.skipped:
                    print(f"      {r.model} seed {r.seed}: {r.error}")
                elif r.ratio is not None and r.ratio < LOW:
                    print(f"      {r.model} seed {r.seed}: KV/truth {r.ratio:.3f}, "
                          f"{r.launches} launches")
    return 1 if failed else 0


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def _min(xs: list[float]) -> str:
    return f"{min(xs):.3f}" if xs else "-"


if __name__ == "__main__":
    sys.exit(main())
