"""Compare `pretuner plan` with what real MindSpore measured, for the CPU reference models.

For each model and length, one pre-run on the mindspore-cpu backend (`pretuner run
--no-validate`, the length pinned) gives MindSpore's `actual peak used`; weights + activations
measured = peak - the KV cache the server allocated. Prints a Markdown table (docs/benchmarks.md's).

    python scripts/mscpu_plan_vs_measured.py [--card 2] [--lengths 512,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pretuner.report.records import R01Derivation, RunReport, read_report


def _pretuner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pretuner", *args], capture_output=True, text=True, timeout=900
    )


def measure(model: str, card: int, length: int, out: Path) -> dict[str, object]:
    plan = json.loads(
        _pretuner("plan", "--model", model, "--card", str(card), "--max-model-len", str(length),
                  "--tp", "1", "--json").stdout
    )
    run = _pretuner("run", "--engine", "mindspore-cpu", "--model", model, "--card", str(card),
                    "--max-model-len", str(length), "--min-model-len", str(length),
                    "--no-validate", "--out", str(out))
    row: dict[str, object] = {
        "model": model, "len": length,
        "plan_wa_gib": round(plan["weights_gib_per_card"] + plan["activation_gib"], 3),
        "plan_kv_tokens": plan["max_kv_tokens"],
    }
    if run.returncode != 0:
        row["measured"] = f"no fit (exit {run.returncode}): {run.stderr.strip()[-120:]}"
        return row
    report = read_report(out)
    if not isinstance(report, RunReport) or not isinstance(report.derivation, R01Derivation):
        row["measured"] = "the run left no r0.1 derivation"
        return row
    der = report.derivation
    row.update(peak_mib=der.actual_peak_mib, wa_gib=der.weights_act_gib,
               kv_tokens=report.final.kv_tokens, seqs=report.final.max_num_seqs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", type=int, default=2)
    parser.add_argument("--models", default="tiny-llama,tiny-mla")
    parser.add_argument("--lengths", default="512,1024,2048,3072")
    args = parser.parse_args()
    print("| model | max_model_len | plan: weights+act GiB | measured peak MiB | measured "
          "weights+act GiB | plan KV tokens | tuned KV tokens | tuned max-num-seqs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for length in (int(n) for n in args.lengths.split(",")):
                r = measure(model, args.card, length, Path(tmp) / f"{model}-{length}")
                if "measured" in r:
                    print(f"| {model} | {length:,} | {r['plan_wa_gib']} | {r['measured']} |||||")
                    continue
                print(f"| {model} | {length:,} | {r['plan_wa_gib']} | {r['peak_mib']:,} | "
                      f"{r['wa_gib']} | {r['plan_kv_tokens']:,} | {r['kv_tokens']:,} | "
                      f"{r['seqs']} |", flush=True)


if __name__ == "__main__":
    main()
