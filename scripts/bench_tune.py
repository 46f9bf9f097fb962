"""Benchmark `pretuner run`'s decisions on the emulated card against what only the emulator knows.

Every built-in model on 24, 32 and 64 GB emulated cards, requested lengths 16384, 32768 and
65536 (where the model allows), TP as plan chooses it and forced to the smallest TP whose
weights fit, several seeds, every third seed on a busy card (another tenant holding 2-10 % of
it). Each run is the whole tuning loop against the emulated server run in this process
(`pretuner.tune.entry.tune_in_process`: same command lines, boot, scheduler, log lines, scanner
and classifier as a real run, no processes); `--subprocess N` also runs N of them end to end
through real server processes and HTTP and checks they decide the same.

Per card size it prints:
  - KV found / the largest KV that truly fits the chosen configuration (r0.1's integer model-use
    split, `pretuner.sim.truth`; the physical split in brackets): median, minimum, the share of
    runs at 0.93 or more, and the minimum against the truth beside the reserve the run kept
    below the free memory (what it measured outside the pool plus its margin: what is lost to
    everything but that reserve);
  - the seed method on the same pre-runs (util 0.9, no headroom) as the baseline, and how many
    of its configurations hold more KV than truly fits (they would run out of memory);
  - validation launches that ran out of memory; runs that ended "infeasible" although the
    truth says a length >= --min-model-len fits; chosen length vs the longest that truly fits;
    launches per run.

    python scripts/bench_tune.py [--seeds 10] [--cards 24,32,64] [--models a,b] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

from pretuner.errors import CardBusyError, InfeasibleError, PretunerError
from pretuner.method import PrerunInputs, derive
from pretuner.models import builtin_specs, resolve
from pretuner.plan.layout import PlanConfig, plan, smallest_weights_layout
from pretuner.sim import memory as mem
from pretuner.sim.executor import tune_in_process
from pretuner.sim.plugin import R01_CARDS
from pretuner.sim.truth import max_length, max_safe_kv
from pretuner.tune.entry import RunOptions, run_tuning
from pretuner.tune.r01.config import CardInfo, TuneResult
from pretuner.units import GIB, MIB

LENGTHS = (16384, 32768, 65536)
MIN_LEN = 4096
MAX_WORLD = 16


class Load(TypedDict):
    """What max_safe_kv takes by keyword of a run's final settings."""

    batched: int
    chunked: bool


@dataclass(frozen=True)
class Case:
    model: str
    card: int
    length: int
    tp: int | None  # None: plan chooses
    seed: int
    occupied_mib: int


@dataclass
class Row:
    case: Case
    outcome: str  # validated | infeasible | error
    detail: str = ""
    tp: int = 0
    kv_gib: float = 0.0
    eff: float = 0.0
    eff_phys: float = 0.0
    eff_reserve: float = 0.0  # against the truth beside the reserve the run kept
    seed_eff: float = 0.0
    seed_over: bool = False
    val_oom: int = 0
    launches: int = 0
    chosen_len: int = 0
    true_len: int = 0
    false_infeasible: bool = False


def cases(models: list[str], cards: list[int], seeds: int) -> Iterator[Case]:
    for model in models:
        spec = resolve(model)
        for card in cards:
            for length in (n for n in LENGTHS if n <= spec.max_position_embeddings):
                cfg = PlanConfig(model=spec, card_gib=card, max_model_len=MIN_LEN)
                small = smallest_weights_layout(cfg)
                chosen: int | None
                try:
                    chosen = plan(PlanConfig(model=spec, card_gib=card, max_model_len=length)).tp
                except PretunerError:
                    chosen = small
                if small is None or chosen is None:
                    continue
                for tp in dict.fromkeys((None if chosen <= MAX_WORLD else 0, small)):
                    if tp == 0 or (tp or chosen) > MAX_WORLD:
                        continue
                    for seed in range(seeds):
                        rng = random.Random(f"bench-{model}-{card}-{length}-{seed}")  # noqa: S311
                        busy = seed % 3 == 2
                        occupied = int(card * 1024 * rng.uniform(0.02, 0.10)) if busy else 0
                        yield Case(model, card, length, tp, seed, occupied)


def _env(case: Case, work: str) -> dict[str, str]:
    return {
        "PRETUNER_SIM_STARTUP_S": "0",
        "PRETUNER_SIM_TEARDOWN_S": "0",
        "PRETUNER_SIM_OCCUPIED_MIB": str(case.occupied_mib),
        "PRETUNER_SIM_STATE_DIR": tempfile.mkdtemp(prefix="card-", dir=work),
    }


def card_info(case: Case) -> CardInfo:
    """What the emulated npu-smi shows: the driver's and the tenant's share used."""
    prof = mem.PROFILES[R01_CARDS[case.card]]
    used = prof.driver_reserved_mib + case.occupied_mib
    return CardInfo(case.card, prof.total_mib - used, "emulated npu-smi")


def models_of(res: TuneResult, case: Case) -> list[mem.CardModel]:
    spec = resolve(case.model)
    p = res.plan
    layout = mem.Layout(tp=p.tp, pp=p.pp, block_size=p.block_size)
    weights = spec.weights_format(p.weights_format).total_bytes
    return mem.card_models(spec, weights, layout, case.seed)


def free_bytes(case: Case) -> int:
    return mem.PROFILES[R01_CARDS[case.card]].free_bytes - case.occupied_mib * MIB


def truth_len(models: list[mem.CardModel], case: Case) -> int:
    free = free_bytes(case)
    return max(max_length(models, free, limit=case.length, chunked=c, granularity=256)
               for c in (False, True))


def one(case: Case, work: str) -> Row:
    opts = RunOptions(model=case.model, engine="sim", card_gib=case.card,
                      max_model_len=case.length, min_model_len=MIN_LEN, tp=case.tp,
                      seed=case.seed, sim_env=_env(case, work))
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    try:
        res = tune_in_process(opts, folder, card_info(case))
    except InfeasibleError as err:
        row = Row(case, "infeasible", str(err))
        try:
            spec = resolve(case.model)
            tp = case.tp or plan(PlanConfig(model=spec, card_gib=case.card,
                                            max_model_len=case.length)).tp
            weights = spec.weights_format(None).total_bytes
            models = mem.card_models(spec, weights, mem.Layout(tp=tp), case.seed)
            row.true_len = truth_len(models, case)
            row.false_infeasible = row.true_len >= MIN_LEN
        except PretunerError:
            pass
        return row
    except CardBusyError as err:  # a true verdict when the tenant leaves too little
        return Row(case, "busy", str(err))
    except PretunerError as err:
        return Row(case, "error", f"{type(err).__name__}: {err}")
    return score(case, res)


def score(case: Case, res: TuneResult) -> Row:
    f = res.derivation.final
    models = models_of(res, case)
    free = free_bytes(case)
    kw: Load = {"batched": f.max_num_batched_tokens, "chunked": f.chunked_prefill}
    r01 = max_safe_kv(models, free, f.max_model_len, **kw)
    phys = max_safe_kv(models, free, f.max_model_len, integer_model_use=False, **kw)
    reserve = int(res.reserve_gib * GIB)
    kept = max_safe_kv(models, free - reserve, f.max_model_len, **kw)
    pre = res.prerun
    assert pre is not None  # noqa: S101
    assert pre.worst_peak_mib is not None  # noqa: S101
    s = pre.settings
    try:  # the seed method: the same pre-run, util 0.9, no headroom
        seed_kv = derive(PrerunInputs(
            card_gib=s.card_gib, util=s.util, model_use_gib=s.model_use_gib,
            actual_peak_mib=pre.worst_peak_mib, kv_bytes_per_token=res.plan.kv_bytes_per_token,
            block_size=s.block_size, max_model_len=s.max_model_len, headroom_gib=0.0,
            max_num_batched_tokens=s.max_num_batched_tokens, final_util=0.9,
        )).final.kv_bytes
    except PretunerError:
        seed_kv = 0  # at util 0.9 not even one sequence fits
    val_oom = sum(1 for o in res.outcomes if o.settings.purpose.value == "validate"
                  and o.kind.value != "ok")
    true_kv = r01.kv_bytes if r01 else 0
    return Row(
        case, "validated" if res.validated else "not-validated", tp=res.plan.tp,
        kv_gib=f.kv_bytes / GIB,
        eff=f.kv_bytes / true_kv if true_kv else 0.0,
        eff_phys=f.kv_bytes / phys.kv_bytes if phys and phys.kv_bytes else 0.0,
        eff_reserve=f.kv_bytes / kept.kv_bytes if kept and kept.kv_bytes else 1.0,
        seed_eff=seed_kv / true_kv if true_kv else 0.0,
        seed_over=seed_kv > (phys.kv_bytes if phys else 0),
        val_oom=val_oom, launches=len(res.outcomes), chosen_len=f.max_model_len,
        true_len=truth_len(models, case),
    )


def _run(args: tuple[Case, str]) -> Row:
    return one(*args)


def summarize(rows: list[Row], cards: list[int]) -> None:
    print(f"{'card':>5} {'runs':>5} {'KV/true med':>11} {'min':>6} {'>=0.93':>6} "
          f"{'reserve-kept min':>16} {'(phys med)':>10} "
          f"{'seed med':>8} {'seed>true':>9} {'val OOM':>7} {'false inf':>9} {'len>1024 off':>12} "
          f"{'launches mean':>13} {'max':>4}")
    for card in cards:
        rs = [r for r in rows if r.case.card == card]
        ok = [r for r in rs if r.outcome == "validated"]
        if not rs:
            continue
        eff = [r.eff for r in ok] or [0.0]
        phys = [r.eff_phys for r in ok] or [0.0]
        seed = [r.seed_eff for r in ok] or [0.0]
        off = sum(1 for r in ok if r.chosen_len < min(r.case.length, r.true_len) - 1024)
        launches = [r.launches for r in ok] or [0]
        share = sum(1 for e in eff if e >= 0.93) / len(eff)
        kept = min((r.eff_reserve for r in ok), default=0.0)
        print(f"{card:>5} {len(rs):>5} {statistics.median(eff):>11.3f} {min(eff):>6.3f} "
              f"{share:>6.1%} {kept:>16.3f} "
              f"{statistics.median(phys):>10.3f} {statistics.median(seed):>8.3f} "
              f"{sum(r.seed_over for r in ok):>9} {sum(r.val_oom for r in ok):>7} "
              f"{sum(r.false_infeasible for r in rs):>9} {off:>12} "
              f"{statistics.mean(launches):>13.2f} {max(launches):>4}")
    ok = [r for r in rows if r.outcome == "validated"]
    print(f"\n{len(rows)} runs: {len(ok)} validated, "
          f"{sum(r.outcome == 'infeasible' for r in rows)} infeasible, "
          f"{sum(r.outcome == 'busy' for r in rows)} card busy, "
          f"{sum(r.outcome not in ('validated', 'infeasible', 'busy') for r in rows)} other")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--cards", default="24,32,64")
    ap.add_argument("--models", default="", help="comma-separated (default: every built-in)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--subprocess", type=int, default=0,
                    help="also run this many cases through real server processes")
    ap.add_argument("--json", dest="json_out", default=None, help="write every row here")
    args = ap.parse_args()
    cards = [int(c) for c in args.cards.split(",")]
    models = [m for m in args.models.split(",") if m] or [
        s.name for s in builtin_specs() if not s.eager_attention
    ]
    with tempfile.TemporaryDirectory(prefix="pretuner-bench-") as work:
        todo = [(c, work) for c in cases(models, cards, args.seeds)]
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(_run, todo, chunksize=4))
        summarize(rows, cards)
        worst = sorted((r for r in rows if r.outcome == "validated"), key=lambda r: r.eff)[:5]
        for r in worst:
            print(f"lowest KV/true: {r.case} -> {r.eff:.3f} (TP{r.tp}, {r.kv_gib:.2f} GiB, "
                  f"{r.launches} launches)")
        for r in rows:
            if r.val_oom or r.false_infeasible or r.outcome in ("error", "not-validated"):
                print(f"{r.outcome}: {r.case} val_oom={r.val_oom} {r.detail[:200]}")
        for r in rows:
            if r.outcome == "validated" and r.chosen_len < min(r.case.length, r.true_len) - 1024:
                print(f"short: {r.case} chose {r.chosen_len:,}, {r.true_len:,} fits")
        if args.subprocess:
            compare_subprocess([c for c, _ in todo], rows, args.subprocess, work)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


def compare_subprocess(cases_: list[Case], rows: list[Row], count: int, work: str) -> None:
    """The same cases through real server processes: they must decide the same."""
    rng = random.Random(1)  # noqa: S311
    picked = rng.sample(range(len(cases_)), min(count, len(cases_)))
    same = 0
    for i in picked:
        case, row = cases_[i], rows[i]
        env = {**_env(case, work), "PRETUNER_SIM_STARTUP_S": "0.05",
               "PRETUNER_SIM_TEARDOWN_S": "0.02"}
        opts = RunOptions(model=case.model, engine="sim", card_gib=case.card,
                          max_model_len=case.length, min_model_len=MIN_LEN, tp=case.tp,
                          seed=case.seed, sim_env=env,
                          out=tempfile.mkdtemp(prefix="sub-", dir=work) + "/run")
        try:
            out = run_tuning(opts, lambda p, d: None)
            # no engine: the r0.1 method
            assert isinstance(out.result, TuneResult)  # noqa: S101
            f = out.result.derivation.final
            got = ("validated", f.max_model_len, round(f.kv_bytes / GIB, 3),
                   len(out.result.outcomes))
        except PretunerError as err:
            got = (type(err).__name__, 0, 0.0, 0)
        want = (row.outcome, row.chosen_len, round(row.kv_gib, 3), row.launches)
        if row.outcome != "validated":
            want = ({"infeasible": "InfeasibleError"}.get(row.outcome, row.outcome), 0, 0.0, 0)
        same += got == want
        if got != want:
            print(f"subprocess differs: {case}: in-process {want}, subprocess {got}")
    print(f"subprocess check: {same}/{len(picked)} runs decided the same through real processes")


if __name__ == "__main__":
    sys.exit(main())
