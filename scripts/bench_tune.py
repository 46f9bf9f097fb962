"""Benchmark `pretuner run` on the emulated card against what only the emulator knows.

For every registry model that fits on the card and every seed, run the whole tuning loop
(real subprocess servers, real HTTP, real signals) with the emulator writing its truth file,
then report:
  - KV efficiency: the tuned KV cache / the largest KV that is safe under full load
    (truth `safe_kv_bytes_full_load`); target >= 0.97 with zero OOM in validation;
  - the same ratio for the seed's manual method on the same pre-run (util 0.9, no headroom),
    the baseline measured in the same run;
  - launches per run (target: 2 when the first pre-run fits, <= 4 with a fallback);
  - pretuner's own overhead per launch (target < 1 s).

    python scripts/bench_tune.py [--seeds 20] [--card 64] [--models a,b] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pretuner.errors import PretunerError
from pretuner.method import PrerunInputs, derive
from pretuner.models import builtin_specs, lookup
from pretuner.plan import PlanConfig, plan
from pretuner.tune.entry import RunOptions, run_tuning
from pretuner.units import GIB


def one(model: str, card: int, seed: int, workdir: str) -> dict[str, object]:
    truth = Path(workdir) / f"{model}-{seed}-truth.json"
    os.environ.update(
        {
            "PRETUNER_SIM_TRUTH": str(truth),
            "PRETUNER_SIM_STARTUP_S": "0.1",
            "PRETUNER_SIM_TEARDOWN_S": "0.05",
            # Each job its own emulated card: two servers on one card really compete.
            "PRETUNER_SIM_STATE_DIR": tempfile.mkdtemp(prefix="card-", dir=workdir),
        }
    )
    opts = RunOptions(
        model=model, backend="sim", card_gib=card, seed=seed, out=f"{workdir}/{model}-{seed}"
    )
    try:
        res = run_tuning(opts, lambda phase, detail: None)
    except PretunerError as err:
        return {"model": model, "seed": seed, "error": str(err)}
    rep = res.report
    t = json.loads(truth.read_text())  # written by the validation launch, the last one
    safe = t["safe_kv_bytes_full_load"]
    d = res.result.derivation
    pre = next(o for o in res.result.outcomes if o.settings.purpose.value == "prerun"
               and o.kind.value == "ok" and o.settings.max_model_len == d.inputs.max_model_len)
    s = pre.settings
    manual = derive(
        PrerunInputs(
            card_gib=s.card_gib, util=s.util, model_use_gib=s.model_use_gib,
            actual_peak_mib=pre.worst_peak_mib or 0, kv_bytes_per_token=d.inputs.kv_bytes_per_token,
            block_size=s.block_size, max_model_len=s.max_model_len, headroom_gib=0.0,
            final_util=0.9,
        )
    )  # fmt: skip
    validation = [o for o in res.result.outcomes if o.settings.purpose.value == "validate"]
    return {
        "model": model,
        "seed": seed,
        "validated": rep["validated"],
        "launches": rep["launches"],
        "fallback": any(o.kind.value != "ok" for o in res.result.outcomes),
        "validation_oom": sum(1 for o in validation if o.kind.value != "ok"),
        "kv_gib": d.final.kv_bytes / GIB,
        "safe_kv_gib": safe / GIB,
        "efficiency": d.final.kv_bytes / safe,
        "manual_efficiency": manual.final.kv_bytes / safe,
        "overhead_s": max(o.overhead_s for o in res.result.outcomes),
    }


def fitting_models(card: int) -> list[str]:
    names = []
    for spec in builtin_specs():
        try:
            p = plan(PlanConfig(model=spec, card_gib=card))
        except PretunerError:
            continue
        if p.requested.fits and p.tp * p.pp <= 16:
            names.append(spec.name)
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--card", type=int, default=64)
    ap.add_argument("--models", default="", help="comma-separated (default: all that fit)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    models = [lookup(m).name for m in args.models.split(",") if m] or fitting_models(args.card)
    with tempfile.TemporaryDirectory(prefix="pretuner-bench-") as work:
        jobs = [(m, args.card, s, work) for m in models for s in range(args.seeds)]
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(one, *zip(*jobs, strict=True)))
    errors = [r for r in rows if "error" in r]
    ok = [r for r in rows if "error" not in r]
    print(f"pretuner run on the emulated {args.card} GiB card: {len(models)} models x "
          f"{args.seeds} seeds = {len(rows)} runs ({len(errors)} failed)")
    print(f"{'model':30} {'eff min':>8} {'eff med':>8} {'manual med':>10} {'ratio':>6} "
          f"{'launches':>9} {'val OOM':>7} {'overhead s':>10}")
    for m in models:
        rs = [r for r in ok if r["model"] == m]
        if not rs:
            continue
        eff = [float(r["efficiency"]) for r in rs]  # type: ignore[arg-type]
        man = [float(r["manual_efficiency"]) for r in rs]  # type: ignore[arg-type]
        launches = sorted({int(r["launches"]) for r in rs})  # type: ignore[call-overload]
        print(f"{m:30} {min(eff):8.3f} {statistics.median(eff):8.3f} "
              f"{statistics.median(man):10.3f} {statistics.median(eff) / statistics.median(man):6.2f} "
              f"{'/'.join(map(str, launches)):>9} {sum(int(r['validation_oom']) for r in rs):7d} "  # type: ignore[call-overload]
              f"{max(float(r['overhead_s']) for r in rs):10.3f}")  # type: ignore[arg-type]
    all_eff = [float(r["efficiency"]) for r in ok]  # type: ignore[arg-type]
    below = sum(1 for e in all_eff if e < 0.97)
    print(f"\nKV efficiency (tuned KV / truth's safe KV under full load): min {min(all_eff):.3f}, "
          f"median {statistics.median(all_eff):.3f}; {below}/{len(all_eff)} runs below 0.97")
    print(f"validation OOMs: {sum(int(r['validation_oom']) for r in ok)}; "  # type: ignore[call-overload]
          f"max overhead per launch {max(float(r['overhead_s']) for r in ok):.3f} s")  # type: ignore[arg-type]
    for r in ok:
        if int(r["validation_oom"]):  # type: ignore[call-overload]
            print(f"validation OOM: {r['model']} seed {r['seed']} (recovered: {r['validated']})")
    for r in errors:
        print(f"FAILED {r['model']} seed {r['seed']}: {r['error']}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
