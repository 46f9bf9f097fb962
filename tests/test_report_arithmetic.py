"""report.md's arithmetic, recomputed from report.json of a real `pretuner run` on the emulated
card: every printed line adds up within the rounding it is printed with."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pretuner.presets.model import numeric_flags
from tests.helpers import R01_QWEN_32_CHUNKED, R01_QWEN_64, FinishedRun

pytestmark = pytest.mark.slow

GIB = 2**30
MIB = 2**20
SHOWN = 0.005  # half the last digit of a figure printed with 2 decimals

SCENARIOS = {
    # The final util (from the card's measured free memory) differs from the pre-run's 0.9.
    "qwen3-8b-64": R01_QWEN_64,
    # Chunked prefill at 40,960 tokens; the pre-runs already ran at the final util.
    "qwen3-8b-32-chunked": R01_QWEN_32_CHUNKED,
}  # fmt: skip


@dataclass(frozen=True)
class Run:
    rep: dict[str, Any]
    md: str

    @property
    def block_gib(self) -> float:
        """One KV block: what the method's block flooring may leave unused."""
        return float(self.flags["block_size"] * self.rep["kv_bytes_per_token"] / GIB)

    @property
    def flags(self) -> dict[str, int | float]:
        """The final server flags that take a number, by their long names."""
        return numeric_flags(self.rep["final"]["flags"])

    def line(self, pattern: str) -> re.Match[str]:
        m = re.search(pattern, self.md, re.MULTILINE)
        assert m is not None, f"no line matches {pattern!r} in report.md:\n{self.md}"
        return m

    def step(self, n: int) -> tuple[str, str]:
        """Derivation step `n` as (formula, result)."""
        m = self.line(rf"^  {n}\. .+?  = (.+?)\s+= (.+)$")
        return m.group(1).strip(), m.group(2).strip()

    def prerun(self) -> dict[str, Any]:
        """The pre-run the derivation rests on: the one whose peak it names."""
        peak = self.rep["derivation"]["actual_peak_mib"]
        steps = [s for s in self.rep["steps"]
                 if s["purpose"] == "prerun" and s["worst_peak_mib"] == peak]  # fmt: skip
        assert steps, "no pre-run in report.json has the derivation's peak"
        return dict(steps[-1]["settings"])


def num(text: str) -> float:
    return float(text.replace(",", ""))


def cached_runs(finished_run: Callable[..., FinishedRun],
                scenarios: dict[str, tuple[str, ...]]) -> Callable[[str], Run]:
    """Each scenario's run (tests/conftest.py: once per session), on first use."""
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            run = finished_run(*scenarios[name])
            assert run.proc.returncode == 0, run.proc.stderr
            cache[name] = Run(run.report(), (run.folder / "report.md").read_text())
        return cache[name]

    return get


@pytest.fixture(scope="module")
def runs(finished_run: Callable[..., FinishedRun]) -> Callable[[str], Run]:
    return cached_runs(finished_run, SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_memory_table_adds_up_to_the_pool_cap(runs: Callable[[str], Run], name: str) -> None:
    r = runs(name)
    rep, d = r.rep, r.rep["derivation"]
    rows = {m.group(1): num(m.group(2))
            for m in re.finditer(r"^\| ([A-Za-z][^|]+?) \| ([\d.]+) \|", r.md, re.MULTILINE)}  # fmt: skip
    wa = rows["weights + activations (pre-run)"]
    headroom = rows["headroom (base + per sequence)"]
    rounding = rows["rounding to integer model-use"]
    kv = rows["KV cache"]
    cap = rows["pool cap (card x util)"]
    # Each row is report.json's figure.
    assert wa == pytest.approx(d["weights_act_gib"], abs=SHOWN + 1e-4)
    assert headroom == pytest.approx(d["headroom_total_gib"], abs=SHOWN + 1e-4)
    assert rounding == pytest.approx(d["rounding_cost_gib"], abs=SHOWN + 1e-4)
    assert kv == pytest.approx(rep["final"]["kv_gib"], abs=SHOWN + 1e-4)
    util = r.flags["gpu_memory_utilization"]
    assert cap == pytest.approx(rep["card_gib"] * util, abs=SHOWN)
    # The parts fill the pool: up to one KV block is left when the KV cache is block-floored.
    assert wa + headroom + rounding + kv == pytest.approx(cap, abs=4 * SHOWN + r.block_gib)
    # And exactly (report.json keeps 4 decimals): the first three are the integer model-use.
    model_use = int(rep["final"]["env"]["vLLM_MODEL_MEMORY_USE_GB"])
    exact = d["weights_act_gib"] + d["headroom_total_gib"] + d["rounding_cost_gib"]
    assert exact == pytest.approx(model_use, abs=3e-4)
    left = rep["card_gib"] * util - model_use - rep["final"]["kv_gib"]
    assert -2e-4 <= left <= r.block_gib + 2e-4


@pytest.mark.parametrize("name", SCENARIOS)
def test_derivation_steps_match_report_json(runs: Callable[[str], Run], name: str) -> None:
    r = runs(name)
    rep, d = r.rep, r.rep["derivation"]
    bpt = rep["kv_bytes_per_token"]
    s = r.prerun()
    # 1. KV cache in the pre-run = card x util - model-use (whole blocks).
    formula, result = r.step(1)
    m = re.fullmatch(r"(\d+) GiB x ([\d.]+) - (\d+) GiB", formula)
    assert m is not None, formula
    assert (int(m.group(1)), num(m.group(2)), int(m.group(3))) == (
        rep["card_gib"], s["util"], s["model_use_gib"]
    )
    kv_prerun = num(result.removesuffix(" GiB"))
    assert kv_prerun == pytest.approx(d["kv_prerun_gib"], abs=SHOWN + 1e-4)
    budget = rep["card_gib"] * s["util"] - s["model_use_gib"]
    assert budget - r.block_gib - 1e-4 <= d["kv_prerun_gib"] <= budget + 1e-4
    # 2. weights + activations = peak - pre-run KV.
    formula, result = r.step(2)
    m = re.fullmatch(r"([\d.]+) GiB peak - ([\d.]+) GiB", formula)
    assert m is not None, formula
    peak, minus = num(m.group(1)), num(m.group(2))
    assert peak == pytest.approx(d["actual_peak_mib"] * MIB / GIB, abs=SHOWN)
    assert minus == kv_prerun
    assert num(result.removesuffix(" GiB")) == pytest.approx(peak - minus, abs=3 * SHOWN)
    assert d["weights_act_gib"] == pytest.approx(
        d["actual_peak_mib"] * MIB / GIB - d["kv_prerun_gib"], abs=2e-4
    )
    # 4. max tokens = max KV / bytes per token, floored to whole blocks.
    formula, result = r.step(4)
    m = re.fullmatch(r"([\d.]+) GiB / ([\d,]+) B/token, block (\d+)", formula)
    assert m is not None, formula
    max_kv, block = num(m.group(1)), int(m.group(3))
    assert (int(num(m.group(2))), block) == (bpt, r.flags["block_size"])
    tokens = int(num(result.removesuffix(" tokens")))
    assert tokens % block == 0
    assert tokens == pytest.approx(max_kv * GIB / bpt, abs=SHOWN * GIB / bpt + block)
    # 5. max-num-seqs (the method's, before headroom) = max tokens // max_model_len.
    formula, result = r.step(5)
    m = re.fullmatch(r"([\d,]+) // ([\d,]+)", formula)
    assert m is not None, formula
    assert int(num(m.group(1))) == tokens
    assert int(num(m.group(2))) == s["max_model_len"]
    assert int(result) == tokens // s["max_model_len"]


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-8b-64",
        "qwen3-8b-32-chunked",
    ],
)
def test_derivation_step_3_subtracts_from_the_cap_it_prints(
    runs: Callable[[str], Run], name: str
) -> None:
    r = runs(name)
    d = r.rep["derivation"]
    # 3. max KV cache = card x util - weights + activations.
    formula, result = r.step(3)
    m = re.fullmatch(r"([\d.]+) GiB - ([\d.]+) GiB", formula)
    assert m is not None, formula
    cap, wa = num(m.group(1)), num(m.group(2))
    flags = r.flags
    assert cap == pytest.approx(r.rep["card_gib"] * flags["gpu_memory_utilization"], abs=SHOWN)
    assert wa == pytest.approx(d["weights_act_gib"], abs=SHOWN + 1e-4)
    assert num(result.removesuffix(" GiB")) == pytest.approx(cap - wa, abs=3 * SHOWN)


@pytest.mark.parametrize("name", SCENARIOS)
def test_final_configuration_lines_add_up(runs: Callable[[str], Run], name: str) -> None:
    r = runs(name)
    rep, d = r.rep, r.rep["derivation"]
    flags, bpt = r.flags, rep["kv_bytes_per_token"]
    model_use = int(rep["final"]["env"]["vLLM_MODEL_MEMORY_USE_GB"])
    seqs, length = flags["max_num_seqs"], flags["max_model_len"]
    # Headroom: base + per sequence beyond the first.
    m = r.line(r"\(headroom ([\d.]+) GiB \+ ([\d.]+) MiB per running sequence beyond the first "
               r"= ([\d.]+) GiB")  # fmt: skip
    base, per_seq, total = num(m.group(1)), num(m.group(2)), num(m.group(3))
    assert base == pytest.approx(d["headroom_gib"], rel=5e-3)
    assert total == pytest.approx(d["headroom_total_gib"], abs=SHOWN + 1e-4)
    assert d["headroom_total_gib"] == pytest.approx(
        d["headroom_gib"] + per_seq * MIB / GIB * (seqs - 1), abs=0.05 * MIB / GIB * seqs + 1e-4
    )
    # vLLM_MODEL_MEMORY_USE_GB = ceil(weights+act + headroom), and what rounding up costs.
    m = r.line(r"vLLM_MODEL_MEMORY_USE_GB = ceil\(([\d.]+) \+ ([\d.]+)\) = (\d+) GiB .*rounding "
               r"up costs ([\d.]+) GiB of KV, about ([\d,]+) tokens")  # fmt: skip
    wa, headroom, use = num(m.group(1)), num(m.group(2)), int(m.group(3))
    cost, lost = num(m.group(4)), int(num(m.group(5)))
    assert (wa, headroom) == (round(d["weights_act_gib"], 2), round(d["headroom_total_gib"], 2))
    assert use == model_use == math.ceil(d["weights_act_gib"] + d["headroom_total_gib"] - 1e-4)
    assert cost == pytest.approx(model_use - d["weights_act_gib"] - d["headroom_total_gib"],
                                 abs=SHOWN + 2e-4)  # fmt: skip
    assert lost == pytest.approx(d["rounding_cost_gib"] * GIB / bpt, abs=1e-4 * GIB / bpt + 1)
    # KV cache per card = card x final util - model-use, in tokens, and the sequences it serves.
    m = r.line(r"KV cache per card = ([\d.]+) GiB - (\d+) GiB = ([\d.]+) GiB = ([\d,]+) tokens "
               r"-> max-num-seqs (\d+) at ([\d,]+) tokens")  # fmt: skip
    cap, minus, kv = num(m.group(1)), int(m.group(2)), num(m.group(3))
    tokens, shown_seqs, shown_len = int(num(m.group(4))), int(m.group(5)), int(num(m.group(6)))
    assert cap == pytest.approx(rep["card_gib"] * flags["gpu_memory_utilization"], abs=SHOWN)
    assert minus == model_use
    assert kv == pytest.approx(cap - minus, abs=2 * SHOWN + r.block_gib)
    assert kv == pytest.approx(rep["final"]["kv_gib"], abs=SHOWN + 1e-4)
    assert tokens == rep["final"]["kv_tokens"]
    assert tokens * bpt == pytest.approx(rep["final"]["kv_gib"] * GIB, abs=1e-4 * GIB)
    assert (shown_seqs, shown_len) == (seqs, length)
    assert seqs * length <= tokens


# -- V1 engines: the final configuration's memory and the soak ---------------------------------

V1_SCENARIOS = {
    # A vision-language model with a soak: the growth and what is held back are parts.
    "qwen3-vl-8b-64-soak": (
        "--model", "qwen3-vl-8b", "--engine", "vllm", "--emulate", "--card", "64", "--tp", "2",
        "--max-model-len", "16384", "--max-num-seqs", "4", "--soak", "24",
    ),
    # A text model: the non-KV peak, the pinned KV and what is left.
    "qwen3-8b-80-text": ("--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "80",
                         "--max-model-len", "8192", "--max-num-seqs", "64"),
}  # fmt: skip
SHOWN_MIB = 0.05 + 1e-6  # half the last digit of a MiB figure printed with one decimal


@pytest.fixture(scope="module")
def v1_runs(finished_run: Callable[..., FinishedRun]) -> Callable[[str], Run]:
    return cached_runs(finished_run, V1_SCENARIOS)


def memory_rows(md: str) -> list[tuple[str, float]]:
    section = md.split("## Memory of the final configuration", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), num(m.group(2)))
            for m in re.finditer(r"^\| (.+?) \| ([\d,.]+) \| [^|]+ \|$", section, re.MULTILINE)]


@pytest.mark.parametrize("name", V1_SCENARIOS)
def test_v1_memory_parts_add_up_to_the_device(v1_runs: Callable[[str], Run], name: str) -> None:
    r = v1_runs(name)
    rep, mem = r.rep, r.rep["derivation"]["memory"]
    rows = memory_rows(r.md)
    parts, (total_label, total) = rows[:-1], rows[-1]
    assert total_label == "device total"
    assert total == mem["device_total_mib"] == rep["steps"][mem["launch"] - 1]["device_total_mib"]
    # The parts, as printed, sum to the device; the last one is the remainder.
    assert sum(v for _, v in parts) == pytest.approx(total, abs=SHOWN_MIB * len(parts))
    values = dict(parts)
    # Each part is report.json's figure, and each figure is what the launch measured.
    step = rep["steps"][mem["launch"] - 1]
    (label, non_kv), *_ = parts
    m = re.search(r"device peak ([\d,]+) MiB - KV held ([\d,.]+) MiB", label)
    assert m is not None, label
    peak, held = num(m.group(1)), num(m.group(2))
    assert non_kv == pytest.approx(peak - held, abs=SHOWN_MIB)
    assert non_kv == pytest.approx(mem["non_kv_peak_mib"], abs=SHOWN_MIB)
    assert held == pytest.approx(step["kv_tokens"] * kv_bytes_per_token(rep) / MIB,
                                 abs=SHOWN_MIB + 1e-6)
    pinned = next(v for k, v in values.items() if k.startswith("pinned KV cache"))
    assert pinned == pytest.approx(rep["derivation"]["kv_cache_memory_bytes"] / MIB, abs=SHOWN_MIB)
    soak = rep["derivation"]["soak"]
    if soak is None:
        assert peak == max(step["device_peaks_mib"].values())
        assert len(parts) == 3
        return
    assert peak == soak["peak_before_mib"]
    growth = next(v for k, v in values.items() if k.startswith("growth under the soak"))
    held_back = next(v for k, v in values.items() if k.startswith("held back for more growth"))
    assert growth == max(0, soak["peak_after_mib"] - soak["peak_before_mib"])
    assert held_back == 2 * (soak["after_mib"] - soak["half_mib"]) == soak["held_back_mib"]
    # The soak's own samples are the launch's.
    last = step["device_last_mib"]
    assert (soak["before_mib"], soak["half_mib"], soak["after_mib"]) == (
        last["images"], last["soak-1"], last["soak-2"])
    # The remainder, recomputed: never negative (the held-back growth is a part of its own).
    free = total - (peak - held) - growth - held_back - pinned
    shown_free = next(v for k, v in values.items() if k.startswith("free at the worst moment"))
    assert shown_free == pytest.approx(free, abs=5 * SHOWN_MIB)
    assert free >= 0


def kv_bytes_per_token(rep: dict[str, Any]) -> int:
    """Qwen3-8B / Qwen3-VL-8B per card: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B / TP."""
    tp: int = rep["tp"]
    return 36 * 8 * 128 * 2 * 2 // tp


def test_v1_soak_lines_add_up(v1_runs: Callable[[str], Run]) -> None:
    r = v1_runs("qwen3-vl-8b-64-soak")
    soak = r.rep["derivation"]["soak"]
    m = r.line(r"after the worst-case burst: ([\d,]+); after the soak's first half: ([\d,]+); "
               r"after the soak: ([\d,]+) = growth after load ([+-][\d,]+) MiB")
    before, half, after, growth = (num(g) for g in m.groups())
    assert (before, half, after) == (soak["before_mib"], soak["half_mib"], soak["after_mib"])
    assert growth == after - before == soak["growth_mib"]
    m = r.line(r"after it: ([\d,]+) MiB, gave back ([\d,]+) MiB")
    reset, gave_back = num(m.group(1)), num(m.group(2))
    assert gave_back == after - reset == soak["reset_gave_back_mib"]
    m = r.line(r"the second half still added ([\d,]+) MiB: 2 x that = ([\d,]+) MiB held back")
    assert num(m.group(1)) == after - half
    assert num(m.group(2)) == 2 * (after - half)
