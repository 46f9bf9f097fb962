"""The emulated V1 card with big models on small cards: quantized weights, `--cpu-offload-gb`
(card, host, per-step cost), `--swap-space`, `--enforce-eager`, the host's memory, and the field
note's failures (fast, in-process; one streamed request over real HTTP)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretuner.launch.probe import stream_complete
from pretuner.models import lookup
from pretuner.models.quant import from_flag, quantized_bytes
from pretuner.sim.inproc import InprocRun
from pretuner.sim.v1 import inproc, offload
from pretuner.sim.v1.memory import CUDA_PROFILES
from pretuner.sim.v1.truth import decode_tokens_per_s, max_kv_bytes
from pretuner.units import GIB

LLAMA70 = "deepseek-r1-distill-llama-70b"
V100 = {"PRETUNER_SIM_PROFILE": "cuda-32", "PRETUNER_SIM_STARTUP_S": "0"}
BNB = ["--quantization", "bitsandbytes"]
# torch's CUDA OOM message as the field note quotes it, figures left free.
TORCH_OOM = re.compile(
    r"CUDA out of memory\. Tried to allocate [\d.]+ [MG]iB\. GPU 0 has a total capacity of "
    r"[\d.]+ GiB of which [\d.]+ (?:[MG]iB|bytes) is free\. Including non-PyTorch memory, this "
    r"process has [\d.]+ GiB memory in use\. Of the allocated memory [\d.]+ GiB is allocated by "
    r"PyTorch, with [\d.]+ (?:[MG]iB|bytes) allocated in private pools \(e\.g\., CUDA Graphs\), "
    r"and [\d.]+ (?:[MG]iB|bytes) is reserved by PyTorch but unallocated\.")


def weights_gib(log: str) -> float:
    m = re.search(r"Model loading took ([\d.]+) GiB", log)
    assert m, log[-2000:]
    return float(m.group(1))


def boot(args: list[str], env: dict[str, str] | None = None, prompts: list[int] | None = None,
         first: int | None = None, max_tokens: int = 16) -> InprocRun:
    return inproc.run(args, {**V100, **(env or {})}, prompts or [], max_tokens, first=first)


def test_bitsandbytes_loads_the_quantized_bytes() -> None:
    spec = lookup(LLAMA70)
    loaded = offload.load(spec, "cuda-32", 1, "bitsandbytes", 0.0)
    assert loaded.total_bytes == quantized_bytes(spec, from_flag("bitsandbytes"))
    assert 36 * GIB < loaded.total_bytes < 38 * GIB  # 140 GB of bf16 at about a quarter


@pytest.mark.parametrize(("offload_gib", "moved_gib"), [(14, 14.0), (60, None)])
def test_offload_moves_decoder_layers_only(offload_gib: float, moved_gib: float | None) -> None:
    spec = lookup(LLAMA70)
    loaded = offload.load(spec, "cuda-32", 1, "bitsandbytes", offload_gib)
    embeddings = 2 * spec.vocab_size * spec.hidden_size * 2
    if moved_gib is not None:
        assert loaded.offloaded_bytes == moved_gib * GIB
    else:  # more than the layers: the layers go, the embedding and lm_head stay
        assert loaded.offloaded_bytes == loaded.total_bytes - embeddings
        assert loaded.on_card_bytes == embeddings


def test_the_card_loads_less_by_what_is_offloaded() -> None:
    args = [LLAMA70, "--max-model-len", "512", "--max-num-batched-tokens", "512",
            "--max-num-seqs", "8", "--enforce-eager", *BNB]
    a = boot([*args, "--cpu-offload-gb", "30"])
    b = boot([*args, "--cpu-offload-gb", "32"])
    assert a.ready, a.log[-2000:]
    assert b.ready, b.log[-2000:]
    assert weights_gib(a.log) - weights_gib(b.log) == pytest.approx(2.0, abs=0.011)
    assert "Loading weights with BitsAndBytes quantization" in a.log


def test_offload_slows_decode_by_the_bytes_over_pcie() -> None:
    spec = lookup(LLAMA70)
    rates = {gib: decode_tokens_per_s(spec, "cuda-32", quantization="bitsandbytes",
                                      cpu_offload_gib=gib) for gib in (10, 20, 30)}
    assert rates[10] > rates[20] > rates[30]
    # each extra GiB costs the same time per token: 1 / PCIe bandwidth
    step = [1 / rates[g] for g in (10, 20, 30)]
    pcie = CUDA_PROFILES["cuda-32"].pcie_gib_s
    assert step[1] - step[0] == pytest.approx(10 / pcie, rel=0.05)
    assert step[2] - step[1] == pytest.approx(10 / pcie, rel=0.05)


def test_the_field_notes_7gb_config_decodes_near_its_measured_speed() -> None:
    """The note measured 0.4 tokens/s with every layer offloaded (60 GiB) on its 32 GB vGPU."""
    res = boot([LLAMA70, "--max-model-len", "512", *BNB, "--cpu-offload-gb", "60",
                "--swap-space", "20", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                "--gpu-memory-utilization", "0.25", "--enforce-eager"], first=496, prompts=[496])
    assert res.ready, res.log[-2000:]
    assert res.first_decode_s is not None
    rate = 15 / res.first_decode_s
    assert 0.2 < rate < 0.6
    assert "Graph capturing" not in res.log


def test_offload_the_host_lacks_kills_the_engine_while_loading() -> None:
    res = boot([LLAMA70, "--max-model-len", "512", *BNB, "--cpu-offload-gb", "30"],
               env={"PRETUNER_SIM_HOST_MIB": str(24 * 1024)})
    assert res.exit_code == 1
    assert not res.ready
    assert "Failed core proc(s): {'EngineCore_DP0': -9}" in res.log
    assert "Model loading took" not in res.log


@pytest.mark.parametrize(("swap", "says"), [("100", "Too large swap space. 100.00 GiB out of "
                                                     "the 128.00 GiB total CPU memory"),
                                            ("60", "Possibly too large swap space.")])
def test_swap_space_is_checked_against_the_host(swap: str, says: str) -> None:
    res = boot(["qwen3-8b", "--max-model-len", "4096", "--swap-space", swap])
    assert says in res.log
    assert res.ready is (swap == "60")


@pytest.mark.parametrize(("args", "says"), [
    ([LLAMA70, "--quantization", "awq"], "Cannot find the config file for awq"),
    (["qwen3-8b", "--quantization", "fp8"], "Minimum capability: 80. Current capability: 70."),
])
def test_quantization_vllm_refuses(args: list[str], says: str) -> None:
    res = boot([*args, "--max-model-len", "4096"])
    assert res.exit_code == 1
    assert says in res.log


def test_fp8_runs_where_the_card_supports_it() -> None:
    res = inproc.run(["qwen3-8b", "--max-model-len", "4096", "--quantization", "fp8"],
                     {"PRETUNER_SIM_PROFILE": "h100-80"}, [100], 4)
    assert res.ready
    assert weights_gib(res.log) < 9.0  # 8-bit linear layers, 16-bit embeddings


def test_the_field_notes_qwen_util_012_has_no_room_for_kv() -> None:
    """The note: 4-bit Qwen3-8B at util 0.12 of 20 GB: 'No available memory for the cache
    blocks', though the weights alone would fit."""
    res = inproc.run(["qwen3-8b", "--max-model-len", "512", *BNB,
                      "--gpu-memory-utilization", "0.12"], {"PRETUNER_SIM_PROFILE": "cuda-20"},
                     [100], 4)
    assert res.exit_code == 1
    assert "No available memory for the cache blocks" in res.log


def test_an_oom_reads_as_torch_words_it() -> None:
    res = boot([LLAMA70, "--max-model-len", "8192", *BNB, "--cpu-offload-gb", "20"])
    assert res.exit_code == 1
    assert TORCH_OOM.search(res.log), res.log[-3000:]
    assert "has a total capacity of 31.70 GiB" in res.log  # the cuda-32 card


def test_truth_grows_with_offload_and_eager() -> None:
    spec = lookup(LLAMA70)

    def kv(offload_gb: str, *, enforce_eager: bool = False) -> int:
        return max_kv_bytes(spec, "cuda-32", seed=0, max_model_len=8192, max_num_seqs=8,
                            max_num_batched_tokens=8192, enforce_eager=enforce_eager,
                            extra_args=(*BNB, "--cpu-offload-gb", offload_gb))

    less = kv("16", enforce_eager=True)
    more = kv("18", enforce_eager=True)
    graphs = kv("18")
    assert less > 0
    assert more - less == pytest.approx(2 * GIB, abs=16 * 2**20)
    assert graphs < more


@pytest.mark.slow
def test_a_streamed_request_sends_each_token_as_it_is_sampled(tmp_path: Path) -> None:
    env = {**os.environ, **V100, "PRETUNER_SIM_STATE_DIR": str(tmp_path / "state"),
           "PRETUNER_SIM_TIME_SCALE": "0.02"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretuner.sim", "vllm", "serve", LLAMA70, "--max-model-len",
             "512", *BNB, "--cpu-offload-gb", "60", "--enforce-eager", "--host", "127.0.0.1",
             "--port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            m = re.search(r"Starting vLLM server on http://127\.0\.0\.1:(\d+)", log.read_text())
            port = int(m.group(1)) if m else None
            time.sleep(0.02)
        assert port is not None
        outcome, arrivals = stream_complete(f"http://127.0.0.1:{port}", LLAMA70,
                                            [1000] * 100, 8, 60)
        assert outcome.ok
        assert outcome.completion_tokens == 8
        assert outcome.prompt_tokens == 100
        assert arrivals is not None
        assert arrivals.chunks == 8
        # 7 decode steps of about 2.8 s emulated each, at time scale 0.02: ~0.39 s
        per_token = (arrivals.last_s - arrivals.first_s) / 7
        expected = 0.02 / decode_tokens_per_s(lookup(LLAMA70), "cuda-32",
                                              quantization="bitsandbytes", cpu_offload_gib=60,
                                              enforce_eager=True)
        assert per_token == pytest.approx(expected, rel=0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
