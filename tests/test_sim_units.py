"""The emulator's pure parts: memory model, log formats, npu-smi layout, argument rules, engine."""

from __future__ import annotations

import datetime as dt
import io
import re
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pretuner.cli import app
from pretuner.models import resolve
from pretuner.sim import memory as mem
from pretuner.sim.argv import Refused, normalize_argv
from pretuner.sim.engine import Engine, OutOfMemory, RankPool, Request
from pretuner.sim.launcher import DEFAULT_ENTRY, child_argv
from pretuner.sim.logs import PoolStats, RankLog, VllmLog, ms_prefix, pool_dump, vllm_prefix
from pretuner.sim.npusmi import render
from pretuner.sim.r01_checks import verify_vllm_config
from pretuner.sim.r01_config import UsageError, parse
from pretuner.sim.scheduler import SchedulerLimits
from pretuner.sim.state import DeviceUse
from pretuner.sim.truth import truth
from pretuner.units import GIB, MIB

SPEC = resolve("qwen3-8b")
WEIGHTS = SPEC.weights_format(None).total_bytes


def card(seed: int = 0, tp: int = 1, factor: float = 1.0) -> mem.CardModel:
    return mem.CardModel(SPEC, WEIGHTS, mem.Layout(tp=tp), mem.perturbed(seed), factor)


# -- memory ------------------------------------------------------------------------------------


def test_perturbation_is_seeded_and_bounded() -> None:
    base = mem.Coefficients()
    a, b, c = mem.perturbed(0), mem.perturbed(0), mem.perturbed(1)
    assert a == b
    assert a != c
    for f in fields(base):
        ratio = getattr(c, f.name) / getattr(base, f.name)
        assert 1 - mem.PERTURBATION <= ratio <= 1 + mem.PERTURBATION


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60_000), extra=st.integers(1, 10_000), running=st.integers(0, 512))
def test_activation_monotone_and_superlinear(n: int, extra: int, running: int) -> None:
    m = card()
    w = mem.whole
    assert m.activation_bytes(w([n + extra])) > m.activation_bytes(w([n]))
    assert m.activation_bytes(w([2 * n])) > 2 * m.activation_bytes(w([n])) - 2  # quadratic
    assert m.activation_bytes(w([n, n])) < m.activation_bytes(w([2 * n]))  # two short < one long
    # A chunk of a long prompt costs less than the whole prompt, more than a short prompt.
    assert m.activation_bytes([(n, 2 * n)]) < m.activation_bytes(w([2 * n]))
    assert m.activation_bytes([(n, 2 * n)]) > m.activation_bytes(w([n]))
    assert m.dynamic_bytes(w([n]), running) >= m.dynamic_bytes_no_frag(w([n]), running) >= 0
    assert m.sampler_bytes(running + 1) > m.sampler_bytes(running)


def test_weights_shard_with_tp_and_kv_formula() -> None:
    one, two = card(tp=1), card(tp=2)
    assert two.weights_bytes < one.weights_bytes / 2 * 1.05
    assert one.weights_bytes > WEIGHTS  # load overhead
    assert one.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    block = one.block_bytes
    assert mem.r01_kv_blocks(64, 0.9, 50, block) == int((57.6 - 50) * GIB // block)
    assert mem.r01_kv_blocks(64, 0.9, 58, block) < 0


def test_full_load_prefill_and_truth() -> None:
    assert mem.full_load_prefill(16384, 16, 16384) == [(16383, 16383)]
    assert mem.full_load_prefill(4096, 256, 16384) == [(4095, 4095)] * 4
    assert mem.full_load_prefill(4096, 2, 16384) == [(4095, 4095)] * 2
    assert mem.full_load_prefill(65536, 8, 2048, chunked=True) == [(2048, 65535)]
    prof = mem.PROFILES["910b-64"]
    models = [card(3, tp=2, factor=f) for f in (0.99, 1.01)]
    t = truth(models, prof, seed=3, total_gb=64, util=0.9, kv_blocks=100, max_model_len=16384,
              max_num_seqs=8, batched=16384, chunked=False)
    assert t["non_kv_peak_bytes_full_load"] == max(t["non_kv_peak_bytes_per_rank"])
    assert t["non_kv_peak_bytes_per_rank"][1] > t["non_kv_peak_bytes_per_rank"][0]
    assert t["safe_kv_bytes_full_load"] == prof.free_bytes - t["non_kv_peak_bytes_full_load"]
    assert t["safe_kv_bytes_in_pool"] == int(64 * 0.9 * GIB) - t["non_kv_peak_bytes_full_load"]
    assert t["card_free_bytes"] == (65536 - 3379 - 700) * MIB


# -- log formats -------------------------------------------------------------------------------

PEAK = re.compile(r"actual peak used mem:(\d+)M")


@pytest.mark.parametrize(
    ("fmt", "head"),
    [("2.5", 'The dynamic memory pool stat info : {"in used mem":'),
     ("2.6", 'The dynamic memory pool[DefaultAscendMemoryPool] stat info : {"in used mem":'),
     ("bestfit", "The dynamic memory pool total allocated mem:30720M, min addr :0, max addr: 0, "
                 "peak used mem:29331M, actual peak used mem:29614M, in used mem:28688M")],
)
def test_pool_dump_formats(fmt: str, head: str) -> None:
    stats = PoolStats(in_used=int(28688.13 * MIB), peak_used=int(29331.56 * MIB),
                      actual_peak=29614 * MIB + 100, alloc=30720 * MIB)
    line = pool_dump(stats, fmt)
    assert line.startswith(head)
    assert PEAK.findall(line) == ["29614"]
    assert line.endswith("Weight used size:0M, constant value used size:0M, kernel output used "
                         "size:0M, other used size:28688M.")
    if fmt != "bestfit":
        assert '"peak used mem":29331.56MB,"alloc mem":30720.00MB' in line


def test_prefixes() -> None:
    now = dt.datetime(2025, 5, 16, 23, 6, 54, 123456)
    assert ms_prefix("INFO", "PRE_ACT", 123, 0x7F2A, now, "a/b.cc:12", "Fn") == (
        "[INFO] PRE_ACT(123,7f2a,python):2025-05-16-23:06:54.123.456 [a/b.cc:12] Fn] ")
    assert vllm_prefix("INFO", now, "api.py:7") == "INFO 05-16 23:06:54 api.py:7] "


def test_glog_v_filters_info(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setenv("GLOG_v", "2")
    log = RankLog(0, 1, 2, None, out)
    log.log("INFO", "PRE_ACT", "x.cc:1", "F", "hidden")
    log.log("WARNING", "PRE_ACT", "x.cc:1", "F", "shown")
    assert "hidden" not in out.getvalue()
    assert "shown" in out.getvalue()


# -- npu-smi -----------------------------------------------------------------------------------


def test_npu_smi_matches_the_real_910b_layout() -> None:
    prof = mem.PROFILES["910b-64"]
    text = render(prof, [DeviceUse(0, 3379), DeviceUse(1, 41697, ((4242, 38318),))])
    lines = text.splitlines()
    real = [
        "| NPU   Name                | Health        | Power(W)    Temp(C)           "
        "Hugepages-Usage(page)|",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  "
        "HBM-Usage(MB)        |",
        "+===========================+===============+================================="
        "===================+",
        "| 0     910B3               | OK            | 97.5        41                0    / 0"
        "             |",
        "| 0                         | 0000:C1:00.0  | 0           0    / 0          3379 / "
        "65536         |",
    ]
    for line in real:
        assert line in lines
    assert len({len(ln) for ln in lines}) == 1
    hbm = [re.findall(r"(\d+)\s*/\s*(\d+)", ln)[-1] for ln in lines if "0000:" in ln]
    assert hbm == [("3379", "65536"), ("41697", "65536")]
    assert "41697/ 65536" in text
    assert "No running processes found in NPU 0" in text
    assert re.search(r"\| 1 +0 +\| 4242 +\| python3 +\| 38318 +\|", text)


# -- command line and environment --------------------------------------------------------------


def test_parse_flags_env_and_unknown() -> None:
    argv = ["--model", "qwen3-8b", "--max_model_len=4096", "--enforce-eager", "--swap-space",
            "4", "--sim-seed", "7"]
    assert normalize_argv(["--max_model_len=4_0", "x_y"]) == ["--max-model-len=4_0", "x_y"]
    cfg = parse(argv, {"PRETUNER_SIM_SEED": "3", "PRETUNER_SIM_PROFILE": "910b-32",
                       "PRETUNER_SIM_POOL_FORMAT": "bestfit", "PRETUNER_SIM_TEARDOWN_S": "2"})
    assert cfg.max_model_len == 4096
    assert cfg.seed == 7  # the option wins over the env var
    assert cfg.profile == "910b-32"
    assert cfg.pool_format == "bestfit"
    assert cfg.teardown_s == 2.0
    assert "--enforce-eager" in cfg.ignored
    assert parse(["qwen3-8b"], {}).model == "qwen3-8b"
    with pytest.raises(UsageError, match="910b-64"):
        parse(["m", "--sim-profile", "910c"], {})
    with pytest.raises(UsageError, match="model is required"):
        parse([], {})


@pytest.mark.parametrize(
    ("argv", "text"),
    [(["m", "--max-model-len", "50000"], "User-specified max_model_len (50000) is greater"),
     (["m", "--max-model-len", "8192", "--max-num-batched-tokens", "4096"],
      "max_num_batched_tokens (4096) is smaller than max_model_len (8192)"),
     (["m", "--max-model-len", "2048", "--max-num-seqs", "4096"],
      "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs (4096)"),
     (["m", "--tensor-parallel-size", "3"], "must be divisible by tensor parallel size (3)")],
)
def test_vllm_config_checks(argv: list[str], text: str) -> None:
    with pytest.raises(Refused) as err:
        verify_vllm_config(parse(argv, {}), SPEC)
    assert text in err.value.message


def test_defaults_follow_vllm() -> None:
    # Above 32K vLLM 0.6.6 turns chunked prefill on, with a 2048-token budget.
    assert verify_vllm_config(parse(["m"], {}), SPEC) == (40960, 2048)
    whole = parse(["m", "--enable-chunked-prefill", "false"], {})
    assert verify_vllm_config(whole, SPEC) == (40960, 40960)
    assert verify_vllm_config(parse(["m", "--max-model-len", "1024"], {}), SPEC) == (1024, 2048)


def test_launcher_argv() -> None:
    assert child_argv(["vllm.entrypoints.openai.api_server", "--model", "m"]) == (
        DEFAULT_ENTRY, ["--model", "m"])
    assert child_argv(["--model", "m"]) == (DEFAULT_ENTRY, ["--model", "m"])


def test_cli_help_says_simulated() -> None:
    result = CliRunner().invoke(app, ["sim", "serve", "--help"])
    assert result.exit_code == 0
    assert "SIMULATED" in result.output
    assert "--max-model-len" in result.output
    smi = CliRunner().invoke(app, ["sim", "npu-smi", "info"])
    assert smi.exit_code == 0
    assert "HBM-Usage(MB)" in smi.output


# -- engine ------------------------------------------------------------------------------------


def _engine(cap: int, seqs: int, batched: int, dead: list[OutOfMemory]) -> Engine:
    m = card()
    kv = 100 * m.block_bytes * 16
    pool = RankPool(m, RankLog(0, 1, 2, None, io.StringIO()), 0, kv)
    limits = SchedulerLimits(16384, seqs, batched, 16, 100 * 16 * 16, pool_cap_bytes=cap)
    return Engine([pool], limits, VllmLog(io.StringIO()), dead.append)


def test_concurrent_prefill_shares_a_step_and_raises_the_peak() -> None:
    dead: list[OutOfMemory] = []
    eng = _engine(60 * GIB, seqs=2, batched=32768, dead=dead)
    reqs = [Request(f"r{i}", 16000, 2) for i in range(2)]
    for r in reqs:
        eng.submit(r)
    eng.start()
    for r in reqs:
        assert r.done.wait(10)
        assert r.error is None
        assert len(r.output) == 2
    eng.stop()
    m = eng.pools[0].model
    assert eng.pools[0].peak_dynamic == m.dynamic_bytes(mem.whole([16000, 16000]), 2)
    assert eng.pools[0].peak_dynamic > m.dynamic_bytes(mem.whole([16000]), 2)
    assert not dead


def test_engine_oom_fails_every_request_and_reports_dead() -> None:
    dead: list[OutOfMemory] = []
    m = card()
    cap = m.static_bytes + 100 * m.block_bytes * 16 + m.dynamic_bytes(mem.whole([100]), 1) + MIB
    eng = _engine(cap, seqs=4, batched=16384, dead=dead)
    reqs = [Request("small", 100, 1), Request("big", 16000, 1)]
    eng.submit(reqs[0])
    eng.start()
    assert reqs[0].done.wait(10)
    assert reqs[0].error is None
    eng.submit(reqs[1])
    assert reqs[1].done.wait(10)
    assert reqs[1].error is not None
    assert "memory isn't enough and alloc failed" in reqs[1].error
    assert len(dead) == 1
    eng.stop()
