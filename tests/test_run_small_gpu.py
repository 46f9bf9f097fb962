"""`pretuner run` with the weights knobs on a small emulated card (real server processes, real
HTTP): `--quantization`, `--cpu-offload-gb`, `--swap-space`, `--enforce-eager` reach every
launch, the run record, report.md, the startup files and presets; speed in the verdict and
`--min-tokens-per-s`; the checks made before any launch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pretuner.engines.base import LaunchSettings, Purpose
from pretuner.engines.v1_knobs import Knobs
from pretuner.engines.v1_launch import read_log
from pretuner.engines.vllm_v1 import ROWS, V1Engine
from pretuner.errors import ServerFailedError
from pretuner.sim.executor import tune_v1_in_process
from pretuner.tune.options import RunOptions
from tests.helpers import FAST_SIM, FinishedRun, cli_env, invoke, run_cli

LLAMA70 = "deepseek-r1-distill-llama-70b"
SMALL = ("--model", LLAMA70, "--engine", "vllm", "--emulate", "--card", "32", "--tp", "1",
         "--max-model-len", "8192", "--max-num-seqs", "8")
KNOBS = ("--quantization", "bitsandbytes", "--cpu-offload-gb", "14", "--swap-space", "2",
         "--enforce-eager")
FLAGS = ["--quantization", "bitsandbytes", "--cpu-offload-gb", "14", "--swap-space", "2",
         "--enforce-eager"]


def settings() -> LaunchSettings:
    return LaunchSettings(purpose=Purpose.VALIDATE, card_gib=32, util=0.9, model_use_gib=0,
                          max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=8192,
                          block_size=16, tp=1, kv_cache_bytes=3 * 2**30)


@pytest.mark.parametrize(("knobs", "flags"), [
    (Knobs(), []),
    (Knobs("bitsandbytes", 14.0, 2.0, True), FLAGS),
    (Knobs(cpu_offload_gib=0.5), ["--cpu-offload-gb", "0.5"]),
    (Knobs(swap_space_gib=0.0), ["--swap-space", "0"]),
])
def test_the_knobs_are_deployed_in_vllms_spelling(knobs: Knobs, flags: list[str]) -> None:
    argv = V1Engine(ROWS["vllm"], simulated=False, knobs=knobs).deploy(settings()).argv()
    assert argv[argv.index("--kv-cache-memory-bytes") + 2:] == flags


def test_the_retune_command_keeps_the_knobs() -> None:
    opts = RunOptions(model=LLAMA70, engine="vllm", emulate=True, quantization="bitsandbytes",
                      cpu_offload_gib=14.0, swap_space_gib=2.0, enforce_eager=True,
                      min_tokens_per_s=0.5)
    line = " ".join(opts.command_line())
    assert ("--quantization bitsandbytes --cpu-offload-gb 14 --swap-space 2 --enforce-eager "
            "--min-tokens-per-s 0.5") in line
    assert RunOptions.from_json(json.loads(json.dumps(opts.to_json()))) == opts


@pytest.fixture(scope="module")
def small_run(finished_run: Callable[..., FinishedRun]) -> Path:
    run = finished_run(*SMALL, *KNOBS)
    assert run.proc.returncode == 0, run.proc.stderr
    assert "weights: loaded as bitsandbytes-nf4-dq" in run.proc.stdout
    assert "speed: decode" in run.proc.stdout
    return run.folder


@pytest.mark.slow
def test_the_knobs_reach_every_launch_and_every_file(small_run: Path, tmp_path: Path) -> None:
    rep = json.loads((small_run / "report.json").read_text())
    assert rep["validated"]
    for n in range(1, rep["launches"] + 1):
        argv = json.loads((small_run / f"launch-{n}" / "command.json").read_text())["argv"]
        assert " ".join(FLAGS) in " ".join(argv)
    assert rep["final"]["flags"][-len(FLAGS):] == FLAGS
    assert rep["final"]["engine_serve_command"][-len(FLAGS):] == FLAGS
    assert " ".join(FLAGS) in (small_run / "serve.sh").read_text()
    assert " ".join(FLAGS) in (small_run / "pretuner-serve.service").read_text()
    config = (small_run / "vllm-config.yaml").read_text()
    for line in ('quantization: "bitsandbytes"', "cpu-offload-gb: 14", "swap-space: 2",
                 "enforce-eager: true"):  # vLLM's --config takes the CLI spelling
        assert line in config
    # The knobs are serve.sh's flags; tuned.env holds only what the server reads.
    assert "PRETUNER_" not in (small_run / "tuned.env").read_text()
    out = tmp_path / "files"
    script = invoke("script", str(small_run), "--out", str(out))
    assert script.returncode == 0, script.stderr
    assert " ".join(FLAGS) in (out / "serve.sh").read_text()
    assert "cpu-offload-gb: 14" in (out / "vllm-config.yaml").read_text()
    presets = tmp_path / "presets"
    presets.mkdir()
    add = invoke("presets", "add", str(small_run), "--out", str(presets))
    assert add.returncode == 0, add.stderr
    (preset,) = presets.glob("*.json")
    data = json.loads(preset.read_text())
    assert data["server_flags"][-len(FLAGS):] == FLAGS
    assert data["weights_format"] == "bitsandbytes-nf4-dq"
    assert data["figures"]["decode_tokens_per_s"] == rep["derivation"]["speed"]["decode_tokens_per_s"]
    assert data["figures"]["cpu_offload_gib"] == 14.0


@pytest.mark.slow  # small_run: an emulated run end to end, 8 s here
def test_the_record_says_where_the_weights_live_and_what_the_fit_costs(small_run: Path) -> None:
    rep = json.loads((small_run / "report.json").read_text())
    w = rep["derivation"]["weights"]
    assert w["quantization"] == "bitsandbytes"
    assert w["enforce_eager"]
    assert w["offloaded_gib_per_card"] == 14.0
    # the sum adds up, and the engine's own figure agrees with the prediction
    assert w["loaded_gib_per_card"] == pytest.approx(
        w["card_weights_gib"] + w["offloaded_gib_per_card"], abs=0.002)
    assert w["card_weights_log_gib"] == pytest.approx(w["card_weights_gib"], abs=0.1)
    assert w["host_provenance"] == "simulated"
    speed = rep["derivation"]["speed"]
    assert speed["how"] == "streamed"
    assert speed["decode_tokens"] == 15
    assert speed["decode_tokens_per_s"] > 0
    assert speed["ttft_s"] > 0
    proof = next(s for s in reversed(rep["steps"]) if s["outcome"] == "ok")
    assert proof["speed"] == speed
    md = (small_run / "report.md").read_text()
    assert "## Speed" in md
    assert "## What these flags do" in md
    assert "It does not move the KV cache to the CPU" in md


@pytest.mark.slow
def test_explain_shows_the_runs_figure(small_run: Path) -> None:
    proc = invoke("explain", "--cpu-offload-gb", "--run", str(small_run))
    assert proc.returncode == 0, proc.stderr
    assert "moves up to N GiB per GPU of model *weights*" in proc.stdout
    assert "--cpu-offload-gb 14: 14.00 GiB of the" in proc.stdout
    assert "tokens/s for one sequence" in proc.stdout


@pytest.mark.slow
def test_a_configuration_slower_than_asked_exits_9_with_its_files(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("run", "--model", "qwen3-8b", "--engine", "vllm", "--emulate", "--card", "24",
                   "--max-model-len", "4096", "--max-num-seqs", "4", "--min-tokens-per-s",
                   "1e9", "--out", str(out), "--json", env=cli_env(**FAST_SIM))
    assert proc.returncode == 9, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["validated"]
    assert rep["derivation"]["min_tokens_per_s"] == 1e9
    (slow,) = rep["given_up"]
    assert slow.startswith("decode ")
    assert "< 1e+09 asked (--min-tokens-per-s)" in slow
    assert "less than asked" in (out / "report.md").read_text()
    assert (out / "serve.sh").exists()


def test_a_host_without_the_offload_is_refused_before_any_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = invoke("run", *SMALL, *KNOBS, "--out", str(out),
                  env=cli_env(**FAST_SIM, PRETUNER_SIM_HOST_MIB="12288"))
    assert proc.returncode == 4, proc.stderr
    assert "--cpu-offload-gb 14 keeps 14.00 GiB of weights in pinned host memory" in proc.stderr
    assert "11.64 GiB the host has available (simulated" in proc.stderr
    assert not out.exists()


def test_a_model_too_big_for_the_card_is_told_what_fits(tmp_path: Path) -> None:
    proc = invoke("run", *SMALL, "--out", str(tmp_path / "run"), env=cli_env(**FAST_SIM))
    assert proc.returncode == 4, proc.stderr
    assert "--quantization bitsandbytes --cpu-offload-gb" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "says"), [
    (["--engine", "vllm", "--emulate", "--quantization", "awq"], "no quantization_config"),
    (["--engine", "vllm", "--emulate", "--quantization", "int3"], "choose one of: bitsandbytes"),
    (["--engine", "vllm", "--emulate", "--cpu-offload-gb", "-1"], "--cpu-offload-gb -1.0 is negative"),
    (["--engine", "vllm", "--emulate", "--min-tokens-per-s", "0"], "--min-tokens-per-s 0.0 must be above 0"),
    (["--engine", "vllm", "--emulate", "--cpu-offload-gb", "2", "--server-arg", "--cpu-offload-gb 3"],
     "--cpu-offload-gb is given twice"),
    (["--engine", "vllm", "--emulate", "--server-arg", "--swap-space lots"], "--server-arg: could not "
     "convert string to float: 'lots'"),
    (["--engine", "vllm-mindspore-r01", "--emulate", "--cpu-offload-gb", "3"], "a V1 engine's flag"),
])
def test_bad_knobs_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    proc = invoke("run", "--model", "qwen3-8b", *args, "--dry-run", env=cli_env(**FAST_SIM))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_vllm_config_file_gives_the_knobs(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("quantization: bitsandbytes\ncpu-offload-gb: 20\nswap-space: 4\n"
                   "enforce-eager: true\n")
    proc = invoke("run", *SMALL, "--config", str(cfg), "--dry-run", "--json",
                  env=cli_env(**FAST_SIM))
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)["first_launch"]["argv"]
    assert " ".join(["--quantization", "bitsandbytes", "--cpu-offload-gb", "20", "--swap-space",
                     "4", "--enforce-eager"]) in " ".join(argv)


def test_a_shared_card_leaving_7_gib_serves_the_70b_at_512_tokens(tmp_path: Path) -> None:
    """The field note's 7 GB budget: another tenant holds the rest of the 32 GB card, so util
    0.9 (and the note's 0.25) is refused; the pre-run's util comes down to what is free."""
    tenant = 32768 - 310 - 7 * 1024  # cuda-32: NVML total - idle - 7 GiB
    opts = RunOptions(model=LLAMA70, engine="vllm", emulate=True, card_gib=32, tp=1, max_model_len=512,
                      max_num_seqs=8, max_num_batched_tokens=512, quantization="bitsandbytes",
                      cpu_offload_gib=60.0, enforce_eager=True,
                      sim_env={"PRETUNER_SIM_OCCUPIED_MIB": str(tenant)})
    r = tune_v1_in_process(opts, tmp_path)
    assert r.validated
    assert r.final.util < 7 / 31.7  # torch's total is 31.70 GiB, of which 7 GiB are free
    assert any(d["decision"] == "lower pre-run util" for d in r.decisions)
    proof = next(o for o in reversed(r.outcomes) if o.settings == r.final)
    assert proof.speed is not None
    assert proof.speed.how == "emulated clock"


def test_an_engine_the_host_cannot_hold_is_a_server_failure_naming_the_host(
        tmp_path: Path) -> None:
    """The host passes the offload check (14 GiB of 15.5 available) but not the server's own
    processes beside it: the kernel kills the engine while it loads (signal 9)."""
    opts = RunOptions(model=LLAMA70, engine="vllm", emulate=True, card_gib=32, tp=1, max_model_len=8192,
                      max_num_seqs=8, quantization="bitsandbytes", cpu_offload_gib=14.0,
                      enforce_eager=True, sim_env={"PRETUNER_SIM_HOST_MIB": "16384"})
    with pytest.raises(ServerFailedError, match="killed by signal 9 while it started: the host"):
        tune_v1_in_process(opts, tmp_path)


@pytest.mark.parametrize(("line", "signal"), [
    ("(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. "
     "Failed core proc(s): {'EngineCore_DP0': -9}", 9),
    ("(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. "
     "Failed core proc(s): {}", None),
])
def test_the_log_names_an_engine_killed_by_a_signal(line: str, signal: int | None,
                                                    tmp_path: Path) -> None:
    (tmp_path / "server.log").write_text(line + "\n")
    assert read_log(tmp_path / "server.log").killed_by_signal == signal


def test_a_knob_given_as_a_server_arg_is_the_runs_knob() -> None:
    """Before pretuner knew them, the knobs went through --server-arg: they still do, and are
    planned, checked and recorded as if given as pretuner's flags (once in the command)."""
    proc = invoke("run", *SMALL, "--server-arg", "--quantization bitsandbytes",
                  "--server-arg", "--cpu-offload-gb 14 --enforce-eager", "--dry-run", "--json",
                  env=cli_env(**FAST_SIM))
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)["first_launch"]["argv"]
    assert argv.count("--cpu-offload-gb") == 1
    assert " ".join(["--quantization", "bitsandbytes", "--cpu-offload-gb", "14",
                     "--enforce-eager"]) in " ".join(argv)
