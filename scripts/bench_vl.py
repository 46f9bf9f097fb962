"""Benchmark the V1 method on vision-language models (issue 18) on emulated 64 GB cards.

For Qwen3-VL-8B TP2 (seed 000's settings: max_model_len 65,536, max-num-seqs 8,
max-num-batched-tokens 32,768) and Qwen3-VL-32B TP2 (seed 001's: max_model_len 16,384,
max-num-seqs 4), several emulator seeds, each run is the whole V1 loop against the emulated
vLLM server in this process (`tune_v1_in_process`: the image worst case through the chat
path, the soak, the growth held back), then scored by what only the emulator knows
(`pretuner.sim.v1.truth`), for a soak 3 times as long as the tuning's:

- the tuned configuration: validated (worst case and soak), and whether it survives the
  longer soak (0 OOM); its KV / the largest KV that survives that load (target >= 0.95);
- the baseline measured in the same run: vLLM's own profiling at util 0.9 (the pre-run);
- the seeds' hand-chosen settings, util 0.95 and 0.97, on the same card and load: the KV their
  profiling gives, whether they survive, and their KV / the truth (failing or wasting).

Every figure is SIMULATED (the emulated card), in GiB of KV per card unless said.

    python scripts/bench_vl.py [--seeds 5] [--soak 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from pretuner.kvmath import kv_bytes_per_token
from pretuner.models import resolve
from pretuner.sim.executor import tune_v1_in_process
from pretuner.sim.v1.truth import Images, max_kv_bytes, util_outcome
from pretuner.tune.entry import RunOptions
from pretuner.tune.pinned.soak import soak_figures
from pretuner.units import GIB

CARD = 64
PROFILE = "cuda-64"
HAND_UTILS = (0.95, 0.97)  # seed 000 (8B) ran 0.95, seed 001 (32B) 0.97
TARGET = 0.95
LONGER = 3


class Shape(TypedDict):
    """The server shape max_kv_bytes and util_outcome take by keyword."""

    seed: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tp: int


@dataclass(frozen=True)
class Setting:
    """A field note's server: the model and the flags it was started with."""

    name: str
    model: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: vLLM's default
    note: str


SETTINGS = (
    Setting("8B", "qwen3-vl-8b", 65536, 8, 32768, "seed 000: TP2, util 0.95"),
    Setting("32B", "qwen3-vl-32b", 16384, 4, None, "seed 001: TP2, util 0.97, video=0"),
)


@dataclass(frozen=True)
class Hand:
    util: float
    kv_bytes: int  # 0: it does not start
    survives: bool


@dataclass(frozen=True)
class Row:
    setting: str
    seed: int
    validated: bool
    launches: int
    kv_bytes: int
    truth_bytes: int  # the largest pinned KV surviving the worst case and the longer soak
    survives_longer: bool
    growth_mib: int | None  # the tuning soak's growth after load, measured
    held_back_mib: int | None
    baseline_bytes: int  # util 0.9's profiled KV: this run's own pre-run (its log's tokens)
    baseline_survives: bool  # util 0.9 served as is, under the same load
    hands: tuple[Hand, ...]
    seconds: float

    @property
    def ratio(self) -> float:
        return self.kv_bytes / self.truth_bytes if self.truth_bytes else 0.0


def run_one(st: Setting, seed: int, soak: int, work: Path) -> Row:
    t0 = time.monotonic()
    opts = RunOptions(model=st.model, engine="vllm", card_gib=CARD, tp=2, seed=seed,
                      max_model_len=st.max_model_len, max_num_seqs=st.max_num_seqs,
                      max_num_batched_tokens=st.max_num_batched_tokens, soak=soak)
    r = tune_v1_in_process(opts, work)
    f = r.final
    spec = resolve(st.model)
    shape: Shape = {"seed": seed, "max_model_len": f.max_model_len,
                    "max_num_seqs": f.max_num_seqs,
                    "max_num_batched_tokens": f.max_num_batched_tokens, "tp": 2}
    longer = Images(None, LONGER * soak, seed)
    truth = max_kv_bytes(spec, PROFILE, images=longer, **shape)
    kv = f.kv_cache_bytes or 0
    soaked = soak_figures(r.outcomes[-1]) if r.outcomes else None
    bpt = kv_bytes_per_token(spec, tp=2)
    base_kv = (r.profiled_kv_tokens or 0) * bpt
    _, base_ok = util_outcome(spec, PROFILE, util=0.9, images=longer, **shape)
    hands = tuple(Hand(u, *util_outcome(spec, PROFILE, util=u, images=longer, **shape))
                  for u in HAND_UTILS)
    return Row(st.name, seed, r.validated, len(r.outcomes), kv, truth, kv <= truth,
               soaked.growth_mib if soaked else None, soaked.held_back_mib if soaked else None,
               base_kv, base_ok, hands, time.monotonic() - t0)


def hand_words(h: Hand, truth: int) -> str:
    if h.kv_bytes == 0:
        return f"util {h.util}: does not start"
    verdict = "survives, wastes" if h.survives else "OOM"
    return (f"util {h.util}: {h.kv_bytes / GIB:.2f} GiB, {verdict} "
            f"({h.kv_bytes / truth:.3f} of truth)")


def print_rows(st: Setting, rows: list[Row], soak: int) -> None:
    print(f"== Qwen3-VL-{st.name} TP2 on emulated {CARD} GB cards ({st.note}); "
          f"max_model_len {st.max_model_len:,}, max-num-seqs {st.max_num_seqs}; "
          f"tuning soak {soak} requests, scored on a soak of {LONGER * soak} ==")
    print(f"{'seed':>4} {'valid':>5} {'launch':>6} {'tuned GiB':>9} {'truth GiB':>9} "
          f"{'tuned/truth':>11} {'OOM@3x':>6} {'growth MiB':>10} {'held back':>9} "
          f"{'util0.9 GiB':>11} {'util0.9/truth':>13}  hand-chosen (same card, same load)")
    print("  (util 0.9: vLLM's own profiling in this run's pre-run; ok/OOM: served as is under "
          "the same load)")
    for r in rows:
        base = (f"{r.baseline_bytes / GIB:>11.2f} {r.baseline_bytes / r.truth_bytes:>9.3f} "
                f"{'ok' if r.baseline_survives else 'OOM':>3}"
                if r.baseline_bytes else f"{'no start':>11} {'-':>13}")
        print(f"{r.seed:>4} {str(r.validated):>5} {r.launches:>6} {r.kv_bytes / GIB:>9.2f} "
              f"{r.truth_bytes / GIB:>9.2f} {r.ratio:>11.3f} {int(not r.survives_longer):>6} "
              f"{r.growth_mib if r.growth_mib is not None else '-':>10} "
              f"{r.held_back_mib if r.held_back_mib is not None else '-':>9} {base}  "
              + "; ".join(hand_words(h, r.truth_bytes) for h in r.hands))
    ratios = [r.ratio for r in rows]
    print(f"tuned/truth: median {statistics.median(ratios):.3f}, min {min(ratios):.3f} "
          f"(target >= {TARGET}); OOM over the {LONGER}x soak: "
          f"{sum(not r.survives_longer for r in rows)} of {len(rows)} (target 0); validated "
          f"{sum(r.validated for r in rows)} of {len(rows)}; launches mean "
          f"{statistics.mean(r.launches for r in rows):.1f}, max {max(r.launches for r in rows)}")
    base_ooms = sum(not r.baseline_survives for r in rows)
    print(f"util 0.9 (vLLM's default, this run's pre-run): OOM under the load in {base_ooms} of "
          f"{len(rows)}; tuned / util 0.9 KV: median "
          f"{statistics.median(r.kv_bytes / r.baseline_bytes for r in rows):.3f}")
    for u in HAND_UTILS:
        hs = [(h, r.truth_bytes) for r in rows for h in r.hands if h.util == u]
        ooms = sum(h.kv_bytes > 0 and not h.survives for h, _ in hs)
        dead = sum(h.kv_bytes == 0 for h, _ in hs)
        kept = [h.kv_bytes / t for h, t in hs if h.survives]
        waste = f", KV/truth where it survives: median {statistics.median(kept):.3f}" \
            if kept else ""
        print(f"hand-chosen util {u}: OOM under the load in {ooms}, no start in {dead}, of "
              f"{len(hs)}{waste}")
    print(f"(all figures simulated; {sum(r.seconds for r in rows):.1f} s)")
    print()


def good(rows: list[Row]) -> bool:
    return all(r.validated and r.survives_longer and r.ratio >= TARGET for r in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="emulator seeds per model (0..N-1)")
    ap.add_argument("--soak", type=int, default=200, help="the tuning soak, requests")
    ap.add_argument("--models", default="8B,32B", help="8B, 32B or both")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.soak < 2:
        ap.error("--seeds must be at least 1 and --soak at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [s for s in SETTINGS if s.name in args.models.split(",")]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for st in chosen:
            rows = [run_one(st, seed, args.soak, Path(tmp) / f"{st.name}-{seed}")
                    for seed in range(args.seeds)]
            print_rows(st, rows, args.soak)
            ok = ok and good(rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
