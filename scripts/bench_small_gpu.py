"""Benchmark big models on small cards: pretuner's cheapest validated fit against the field
note's hand-made settings, on the same emulated CUDA cards (issue 19).

For each emulated card (32, 24, 20 GB) and model (DeepSeek-R1-Distill-Llama-70B, Qwen3-8B) at
8,192 tokens, and for the note's 7 GB budget (the 32 GB card with another tenant holding all
but 7 GiB) at 512 tokens:

1. pretuner: `plan --engine vllm` proposes the quantization and the fewest whole GiB of
   `--cpu-offload-gb` (predicted); each candidate is then a whole `pretuner run` (pre-run,
   derive, validate under the worst-case load, in process on the emulated server), from the
   proposal down while it validates and up while it does not, with CUDA graphs and, where
   graphs leave no room, `--enforce-eager`. The smallest offload that validates is the fit:
   least host memory, fastest decode. Its decode tokens/s and time to first token are what
   its validation measured (the emulated card's clock).
2. The emulator's truth for that configuration: the smallest offload that serves one
   max-length sequence at all, and the largest pinned KV that survives (`sim.v1.truth`).
3. The note's hand-made settings, started as the note starts them (util mode, no pinned KV),
   then one max-length request alone and as many as its KV holds: did it start, did it serve,
   how fast, how much KV; measured in the same run, on the same card.

All figures are simulated (the emulated card), never measured on a GPU.

    python scripts/bench_small_gpu.py [--cards 32,24,20] [--models a,b] [--no-budget]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pretuner.errors import PretunerError
from pretuner.models import resolve
from pretuner.plan.layout import PlanConfig
from pretuner.plan.propose import propose
from pretuner.sim.executor import tune_v1_in_process
from pretuner.sim.plugin import V1_CARDS as SIM_PROFILES
from pretuner.sim.v1 import inproc
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.sim.v1.truth import decode_tokens_per_s, max_kv_bytes
from pretuner.speed import Speed
from pretuner.tune.options import RunOptions
from pretuner.tune.pinned.loop import V1Result
from pretuner.units import GIB

LLAMA70 = "deepseek-r1-distill-llama-70b"
QWEN8 = "qwen3-8b"
LENGTH = 8192
SEQS = 8  # a small card's production: a few users
BUDGET_GIB = 7  # the note's 7 GB: another tenant holds the rest of the 32 GB card
BUDGET_LEN = 512
MAX_STEPS = 12  # offload candidates tried per card and model
DECODE = 16  # tokens each validation request generates (the tuner's own)


@dataclass(frozen=True)
class Fit:
    """pretuner's cheapest validated configuration on one card."""

    quantization: str | None
    offload_gib: int
    eager: bool
    result: V1Result | None
    tried: int  # whole pretuner runs made
    error: str | None = None

    @property
    def flags(self) -> str:
        parts = [f"--quantization {self.quantization}" if self.quantization else "bf16"]
        if self.offload_gib:
            parts.append(f"--cpu-offload-gb {self.offload_gib}")
        if self.eager:
            parts.append("--enforce-eager")
        return " ".join(parts)


@dataclass(frozen=True)
class HandMade:
    """The note's settings run as the note runs them."""

    label: str
    argv: tuple[str, ...]
    started: bool
    served: int  # max-length requests answered
    sent: int
    kv_tokens: int | None
    decode_tps: float | None
    ttft_s: float | None
    why: str


def _opts(model: str, card: int, length: int, quant: str | None, offload: int, eager: bool,
          sim_env: dict[str, str]) -> RunOptions:
    return RunOptions(model=model, engine="vllm", card_gib=card, tp=1, max_model_len=length,
                      max_num_seqs=SEQS, max_num_batched_tokens=max(length, SEQS),
                      quantization=quant, cpu_offload_gib=float(offload), enforce_eager=eager,
                      sim_env=sim_env)


def _try(opts: RunOptions, work: Path) -> V1Result | None:
    try:
        r = tune_v1_in_process(opts, work)
    except PretunerError:
        return None
    return r if r.validated else None


def proposal(model: str, card_gib: int, length: int) -> tuple[str | None, int]:
    """What `plan --engine vllm --tp 1 --card card_gib` proposes: the quantization, the
    offload (GiB). A shared card is planned by what it leaves (the budget)."""
    cfg = PlanConfig(model=resolve(model), card_gib=card_gib, util=0.9, max_model_len=length,
                     tp=1, engine="vllm")
    p = propose(cfg)
    if p.chosen is None:
        return "bitsandbytes", 0
    quant = p.chosen.quantization.split("-")[0] if p.chosen.quantization else None
    return quant, p.chosen.cpu_offload_gib


def smallest_fit(model: str, card: int, length: int, work: Path, sim_env: dict[str, str],
                 budget_gib: int | None = None) -> Fit:
    """The fewest whole GiB offloaded that a whole pretuner run validates (graphs first)."""
    quant, start = proposal(model, budget_gib or card, length)
    tried = 0
    best: Fit | None = None
    for eager in (False, True):
        found: dict[int, V1Result | None] = {}

        def run(gib: int, eager: bool = eager, found: dict[int, V1Result | None] = found
                ) -> V1Result | None:
            nonlocal tried
            if gib not in found:
                tried += 1
                found[gib] = _try(_opts(model, card, length, quant, gib, eager, sim_env),
                                  work / f"{'eager' if eager else 'graphs'}-{gib}")
            return found[gib]

        gib = start
        while run(gib) is None and len(found) < MAX_STEPS:
            gib += 1
        if found.get(gib) is None:
            continue
        while gib > 0 and run(gib - 1) is not None:
            gib -= 1
        fit = Fit(quant, gib, eager, found[gib], tried)
        if best is None or fit.offload_gib < best.offload_gib:
            best = fit
        if gib == 0:
            break
    return best or Fit(quant, start, True, None, tried, "nothing validated")


def _knob_args(fit: Fit, r: V1Result, gib: int) -> tuple[str, ...]:
    """The fit's flags for the truth (the util the run kept: a shared card refuses 0.9)."""
    quant = ("--quantization", fit.quantization) if fit.quantization else ()
    return (*quant, "--cpu-offload-gb", str(gib), "--gpu-memory-utilization",
            f"{r.final.util:g}")


def truth_smallest_offload(model: str, card: int, length: int, fit: Fit, r: V1Result,
                           occupied_mib: int) -> int | None:
    """The emulator's smallest whole-GiB offload that serves one max-length sequence."""
    spec = resolve(model)
    for gib in range(fit.offload_gib + 1):
        kv = max_kv_bytes(spec, SIM_PROFILES[card], seed=0, max_model_len=length,
                          max_num_seqs=SEQS, max_num_batched_tokens=max(length, SEQS),
                          enforce_eager=fit.eager, occupied_mib=occupied_mib,
                          extra_args=_knob_args(fit, r, gib))
        if kv:
            return gib
    return None


def truth_kv(model: str, card: int, fit: Fit, r: V1Result, occupied_mib: int) -> int:
    f = r.final
    return max_kv_bytes(resolve(model), SIM_PROFILES[card], seed=0,
                        max_model_len=f.max_model_len, max_num_seqs=f.max_num_seqs,
                        max_num_batched_tokens=f.max_num_batched_tokens, enforce_eager=fit.eager,
                        occupied_mib=occupied_mib,
                        extra_args=_knob_args(fit, r, fit.offload_gib))


def hand_made(label: str, argv: list[str], card: int, occupied_mib: int) -> HandMade:
    """Start the note's command as it stands, send the worst case alone, then what fits."""
    env = {"PRETUNER_SIM_PROFILE": SIM_PROFILES[card],
           "PRETUNER_SIM_OCCUPIED_MIB": str(occupied_mib)}
    mml = int(argv[argv.index("--max-model-len") + 1])
    seqs = int(argv[argv.index("--max-num-seqs") + 1]) if "--max-num-seqs" in argv else 256
    plen = mml - DECODE
    boot = inproc.run(argv, env, [], DECODE)
    if not boot.ready:
        return HandMade(label, tuple(argv), False, 0, 0, None, None, None, _why(boot.log))
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", boot.log)
    kv = int(m.group(1).replace(",", "")) if m else None
    many = max(1, min(seqs, (kv or mml) // mml))
    res = inproc.run(argv, env, [plen] * many, DECODE, first=plen)
    served = sum(r.status == 200 for r in res.replies)
    rate = (DECODE - 1) / res.first_decode_s if res.first_decode_s else None
    why = "served" if served == len(res.replies) else _why(res.log)
    return HandMade(label, tuple(argv), True, served, len(res.replies), kv, rate,
                    res.first_ttft_s, why)


def _why(log: str) -> str:
    for pattern, words in ((r"Tried to allocate ([\d.]+ [MG]iB)", "CUDA OOM ({})"),
                           (r"(No available memory for the cache blocks)", "{}"),
                           (r"Free memory on device \S+ \(([\d./]+) GiB\)",
                            "refused: util x total above the free {} GiB"),
                           (r"estimated maximum model length is (\d+)",
                            "KV holds less than one sequence (max {})")):
        m = re.search(pattern, log)
        if m:
            return words.format(m.group(1))
    return "failed"


NOTE_70B_32G = [LLAMA70, "--quantization", "bitsandbytes", "--cpu-offload-gb", "20",
                "--swap-space", "4", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256",
                "--max-num-batched-tokens", "8192", "--max-model-len", "8192", "--block-size",
                "32"]
NOTE_70B_7G = [LLAMA70, "--quantization", "bitsandbytes", "--cpu-offload-gb", "60",
               "--swap-space", "20", "--gpu-memory-utilization", "0.25", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "512", "--max-model-len", "512", "--block-size", "16",
               "--enforce-eager"]
NOTE_QWEN = [QWEN8, "--quantization", "bitsandbytes", "--gpu-memory-utilization", "0.9",
             "--max-model-len", "8192", "--max-num-seqs", "256"]
NOTE_QWEN_012 = [QWEN8, "--quantization", "bitsandbytes", "--gpu-memory-utilization", "0.12",
                 "--max-model-len", "512"]


def budget_occupied_mib(card: int, budget_gib: int) -> int:
    """The tenant that leaves `budget_gib` GiB of torch's capacity on the card."""
    p = CUDA_PROFILES[SIM_PROFILES[card]]
    return p.nvml_total_mib - p.idle_mib - budget_gib * 1024


def proof_speed(r: V1Result) -> Speed | None:
    """What the validation that proved the final configuration measured."""
    return next((o.speed for o in reversed(r.outcomes) if o.settings == r.final and o.speed),
                None)


def report_fit(model: str, card: int, length: int, fit: Fit, occupied: int) -> bool:
    """Print pretuner's fit beside the truth; False when nothing validated, no speed was
    measured or the validated KV is above what truly survives (an OOM left undetected)."""
    r = fit.result
    if r is None:
        print(f"  pretuner: {fit.error} after {fit.tried} runs")
        return False
    sp = proof_speed(r)
    if sp is None:
        print("  pretuner: validated, but its validation measured no speed")
        return False
    kv = r.final.kv_cache_bytes or 0
    truth = truth_kv(model, card, fit, r, occupied)
    least = truth_smallest_offload(model, card, length, fit, r, occupied)
    model_tps = decode_tokens_per_s(resolve(model), SIM_PROFILES[card],
                                    quantization=fit.quantization,
                                    cpu_offload_gib=fit.offload_gib, enforce_eager=fit.eager)
    print(f"  pretuner: {fit.flags}, --kv-cache-memory-bytes {kv} ({kv / GIB:.2f} GiB, "
          f"{r.kv_tokens or 0:,} tokens = {(r.kv_tokens or 0) / length:.2f} x {length:,}); "
          f"validated in {len(r.outcomes)} launches; {fit.tried} whole runs searched")
    print(f"    speed: decode {sp.decode_tokens_per_s or 0:.2f} tokens/s (one sequence; the "
          f"card's model: {model_tps:.2f}), first token after {sp.ttft_s:.2f} s "
          f"({sp.prompt_tokens:,}-token prompt)")
    print(f"    truth: smallest offload that serves {length:,} at all: {least} GiB "
          f"(found {fit.offload_gib}); largest pinned KV that survives {truth / GIB:.2f} GiB, "
          f"found/truth {kv / truth if truth else 0:.3f}, fits: {kv <= truth}")
    return kv <= truth


def report_hand(h: HandMade, fit: Fit) -> None:
    rate = f"{h.decode_tps:.2f} tokens/s" if h.decode_tps else "-"
    kv = f"{h.kv_tokens:,} KV tokens" if h.kv_tokens else "no KV"
    served = f"{h.served}/{h.sent} max-length requests served" if h.started else "did not start"
    line = f"  hand-made ({h.label}): {served}, {kv}, decode {rate}; {h.why}"
    sp = proof_speed(fit.result) if fit.result is not None else None
    mine = sp.decode_tokens_per_s if sp is not None else None
    if h.decode_tps and mine:
        line += f"; pretuner decodes {mine / h.decode_tps:.2f}x as fast"
    print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cards", default="32,24,20")
    ap.add_argument("--models", default=f"{LLAMA70},{QWEN8}")
    ap.add_argument("--no-budget", action="store_true", help="skip the 7 GB budget")
    args = ap.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for card in (int(c) for c in args.cards.split(",")):
            for model in args.models.split(","):
                print(f"== emulated {card} GB ({SIM_PROFILES[card]}), {model}, max_model_len "
                      f"{LENGTH:,}, max-num-seqs {SEQS} ==")
                fit = smallest_fit(model, card, LENGTH, work / f"{card}-{model}", {})
                failed += not report_fit(model, card, LENGTH, fit, 0)
                notes = {LLAMA70: [("the note's 32 GB config", NOTE_70B_32G),
                                   ("the same with --enforce-eager",
                                    [*NOTE_70B_32G, "--enforce-eager"])],
                         QWEN8: [("the note's 4-bit recipe", NOTE_QWEN),
                                 ("the note's util 0.12", NOTE_QWEN_012)]}[model]
                for label, note_argv in notes:
                    report_hand(hand_made(label, note_argv, card, 0), fit)
                print()
        if not args.no_budget:
            occupied = budget_occupied_mib(32, BUDGET_GIB)
            print(f"== the note's {BUDGET_GIB} GB budget: the emulated 32 GB card with another "
                  f"tenant holding {occupied:,} MiB, {LLAMA70}, max_model_len {BUDGET_LEN} ==")
            env = {"PRETUNER_SIM_OCCUPIED_MIB": str(occupied)}
            fit = smallest_fit(LLAMA70, 32, BUDGET_LEN, work / "budget", env, BUDGET_GIB)
            failed += not report_fit(LLAMA70, 32, BUDGET_LEN, fit, occupied)
            report_hand(hand_made("the note's 7 GB config", NOTE_70B_7G, 32, occupied), fit)
            report_hand(hand_made("the note's 7 GB config on the whole card", NOTE_70B_7G, 32, 0),
                        fit)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
