"""`pretuner run --engine vllm` for a vision-language model, end to end on the emulated 64 GB
card: real server processes, real HTTP with generated PNGs through the chat API, the emulated
device sampled in the background; the soak, its growth held back, and the files it writes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pretuner.devices.series import parse_memory_tsv
from pretuner.launch.images import image_shape, worst_case_images
from pretuner.models import resolve
from pretuner.presets.model import preset_from_report
from pretuner.report.records import RunReport, read_report
from pretuner.sim.executor import tune_v1_in_process
from pretuner.sim.v1.truth import Images, max_kv_bytes, survives
from pretuner.tune.entry import RunOptions
from pretuner.tune.pinned.setup import DEFAULT_SOAK
from tests.helpers import FinishedRun, first_launch_line, invoke

ARGS = ("--model", "qwen3-vl-8b", "--engine", "vllm", "--emulate", "--card", "64", "--tp", "2",
        "--max-model-len", "16384", "--max-num-seqs", "4", "--soak", "24",
        "--limit-mm-per-prompt", "image=1", "--mm-processor-cache-gb", "2")


@pytest.fixture(scope="module")
def run(finished_run: Callable[..., FinishedRun]) -> tuple[Path, dict[str, Any]]:
    done = finished_run(*ARGS, "--json")
    assert done.proc.returncode == 0, done.proc.stderr
    return done.folder, json.loads(done.proc.stdout)


@pytest.mark.slow
def test_the_worst_case_and_the_soak_ran_through_the_chat_api(
        run: tuple[Path, dict[str, Any]]) -> None:
    out, rep = run
    assert rep["validated"]
    images = rep["derivation"]["images"]
    assert images["image_limit"] == 1
    assert images["image_limit_source"] == "--limit-mm-per-prompt"
    # 16,384 tokens hold no 4096 x 4096 image (16,384 tokens) beside the template and text:
    # the worst case is the largest image that fits
    vision = resolve("qwen3-vl-8b").vision
    assert vision is not None
    count, side = worst_case_images(image_shape(vision, 1), 16384, 1)
    assert (count, side) == (1, 4064)
    assert (images["worst_case_images"], images["worst_case_image_px"]) == (1, [side, side])
    assert (images["encoder_budget_tokens"], images["encoder_profiled_images"]) == (16384, 1)
    assert images["flags"] == ["--limit-mm-per-prompt", '{"image":1}',
                               "--mm-processor-cache-gb", "2"]
    soak = rep["derivation"]["soak"]
    assert soak["requests"] == 24
    assert soak["reset_status"] == 200  # the tuning launch ran in vLLM's dev mode
    assert soak["reset_gave_back_mib"] == 0  # as seed 001: the reset gives nothing back
    assert soak["growth_mib"] > 0
    final = rep["steps"][soak["launch"] - 1]
    assert final["outcome"] == "ok"
    assert final["soak_requests"] == 24
    log = Path(final["log"]).read_text()
    assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') >= 24 + 2 * 4
    assert '"POST /reset_mm_cache HTTP/1.1" 200' in log
    mem = parse_memory_tsv(soak["launch"], (out / f"launch-{soak['launch']}" / "memory.tsv")
                           .read_text())
    phases = {r.phase for r in mem.rows}
    assert {"images", "soak-1", "soak-2", "reset", "after-soak"} <= phases
    # The soak's rate: the least-squares slope of the worst device over the soak's samples,
    # fitted here again from memory.tsv; a 24-request soak lasts seconds: an upper bound.
    worst: dict[float, int] = {}
    for r in mem.rows:
        if r.phase in ("soak-1", "soak-2"):
            worst[r.t_s] = max(worst.get(r.t_s, 0), r.used_mib)
    t = np.array(sorted(worst))
    slope_h = np.polyfit(t, [worst[x] for x in t], 1)[0] * 3600
    assert soak["rate_bound"] == "upper bound"
    assert soak["rate_samples"] == len(t) >= 3
    assert soak["rate_mib_per_h"] == pytest.approx(slope_h, abs=0.06)
    assert soak["rate_mib_per_h"] > 0  # the emulated encoder cache grows with distinct images
    assert soak["headroom_mib"] == mem.total_mib - soak["after_mib"] > 0
    assert soak["exhaustion_h"] == pytest.approx(soak["headroom_mib"] / slope_h, abs=0.06)


@pytest.mark.slow
def test_the_proven_kv_survives_the_same_load_in_the_emulators_truth(
        run: tuple[Path, dict[str, Any]]) -> None:
    _, rep = run
    f = rep["final"]
    spec = resolve("qwen3-vl-8b")
    argv = ["qwen3-vl-8b", "--max-model-len", "16384", "--max-num-seqs", "4", "-tp", "2",
            "--max-num-batched-tokens", str(f["max_num_batched_tokens"]),
            "--kv-cache-memory-bytes", str(rep["derivation"]["kv_cache_memory_bytes"])]
    env = {"PRETUNER_SIM_PROFILE": "cuda-64", "PRETUNER_SIM_SEED": "0",
           "PRETUNER_SIM_STARTUP_S": "0"}
    assert survives(spec, argv, env, Images(1, 24, 0))


@pytest.mark.slow  # emulated tunings end to end (in-process)
@pytest.mark.parametrize("seed", [0, 1])
def test_with_the_default_soak_no_oom_over_a_soak_three_times_longer(
        tmp_path: Path, seed: int) -> None:
    opts = RunOptions(model="qwen3-vl-8b", engine="vllm", emulate=True, card_gib=64, tp=2, seed=seed,
                      max_model_len=16384, max_num_seqs=4, limit_mm_per_prompt="image=1")
    r = tune_v1_in_process(opts, tmp_path)
    assert r.validated
    f = r.final
    longer = max_kv_bytes(resolve("qwen3-vl-8b"), "cuda-64",
                          images=Images(1, 3 * DEFAULT_SOAK, seed), seed=seed,
                          max_model_len=16384, max_num_seqs=4, tp=2,
                          max_num_batched_tokens=f.max_num_batched_tokens)
    assert f.kv_cache_bytes is not None
    assert 0.95 * longer <= f.kv_cache_bytes <= longer


@pytest.mark.slow
def test_the_flags_reach_serve_sh_and_the_preset(run: tuple[Path, dict[str, Any]]) -> None:
    out, rep = run
    serve = (out / "serve.sh").read_text()
    assert "--limit-mm-per-prompt '{\"image\":1}'" in serve
    assert "--mm-processor-cache-gb 2" in serve
    assert "VLLM_SERVER_DEV_MODE" not in serve  # the reset route was for the tuning only
    config = (out / "vllm-config.yaml").read_text()
    assert "mm-processor-cache-gb: 2" in config  # vLLM's --config: the CLI spelling
    record = read_report(out)
    assert isinstance(record, RunReport)
    preset = preset_from_report(record, date="2026-01-01")
    assert preset.server_flags is not None
    flags = preset.server_flags
    assert flags[flags.index("--limit-mm-per-prompt") + 1] == '{"image":1}'
    assert flags[flags.index("--mm-processor-cache-gb") + 1] == "2"
    md = (out / "report.md").read_text()
    assert "## Images" in md
    assert "## Soak" in md
    assert re.search(r"\| held back for more growth: 2 x what the soak's second half", md)
    html = (out / "report.html").read_text()
    assert 'class="band soak"' in html
    assert "growth under the soak" in html
    # The rate and the projection, as report.json has them, in report.md and by the chart
    soak = rep_soak(out)
    h = soak["exhaustion_h"]
    rate = f"growth rate at most {soak['rate_mib_per_h']:,.1f} MiB/h"
    hours = (f"used up in at least {h * 60:,.1f} min" if h < 1 else
             f"used up in at least {h:,.1f} h") + " at that rate (derived)"
    assert rate in md
    assert hours in md
    assert f"headroom {soak['headroom_mib']:,} MiB (device total - the soak" in md
    assert re.search(rf'<p class="soak-rate">soak {re.escape(rate)}.*{re.escape(hours)}</p>',
                     html)


def rep_soak(out: Path) -> dict[str, Any]:
    soak: dict[str, Any] = json.loads((out / "report.json").read_text())["derivation"]["soak"]
    return soak


@pytest.mark.parametrize(("args", "says"), [
    pytest.param(("--model", "qwen3-8b", "--soak", "10"), "--soak: qwen3-8b is a text model",
                 id="text-model-soak"),
    pytest.param(("--model", "qwen3-8b", "--limit-mm-per-prompt", "image=1"),
                 "text model", id="text-model-limit"),
    pytest.param(("--model", "qwen3-vl-8b", "--limit-mm-per-prompt", "image=x"),
                 "is not MODALITY=COUNT", id="bad-limit"),
    pytest.param(("--model", "qwen3-vl-8b", "--soak", "-1"), "--soak", id="negative-soak"),
    pytest.param(("--model", "qwen3-vl-8b", "--soak-minutes", "0"), "--soak-minutes",
                 id="zero-minutes"),
    pytest.param(("--model", "qwen3-vl-8b", "--soak-minutes", "1h30"),
                 "'1h30' is not a duration", id="bad-duration"),
    pytest.param(("--model", "qwen3-vl-8b", "--server-arg", "--limit-mm-per-prompt.image=2"),
                 "pretuner sets --limit-mm-per-prompt itself", id="dotted-server-arg"),
])
def test_bad_vision_input_is_one_line_and_exit_2(args: tuple[str, ...], says: str) -> None:
    proc = invoke("run", *args, "--engine", "vllm", "--emulate", "--card", "64", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_r01_method_refuses_image_flags() -> None:
    proc = invoke("run", "--model", "qwen3-vl-8b", "--engine", "vllm-mindspore-r01", "--emulate",
                  "--soak", "50", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert "--soak: the r0.1 method sends no images" in proc.stderr


@pytest.mark.parametrize("engine", ["vllm-mindspore-r01", "vllm"])
def test_soak_0_is_no_soak_on_every_engine(engine: str) -> None:
    # `--soak 0` means none (--help): a text model takes it on either method, as a sweep that
    # sets it for every tuning needs.
    proc = invoke("run", "--model", "qwen3-8b", "--engine", engine, "--emulate", "--card", "64",
                  "--soak", "0", "--dry-run")
    assert proc.returncode == 0, proc.stderr


def test_dry_run_says_what_the_images_will_be() -> None:
    proc = invoke("run", "--model", "qwen3-vl-8b", "--engine", "vllm", "--emulate", "--card", "64",
                  "--tp", "2", "--max-model-len", "65536", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "3 image(s) of 4096x4096 px (16,384 tokens each)" in proc.stdout
    assert "a soak of 200 requests" in proc.stdout


def test_a_vllm_config_file_gives_the_image_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: qwen3-vl-8b\nlimit-mm-per-prompt:\n  image: 2\n  video: 0\n"
                   "mm_processor_cache_gb: 0\n")
    proc = invoke("run", "--engine", "vllm", "--emulate", "--card", "64", "--config", str(cfg), "--dry-run",
                  "--max-model-len", "65536")
    assert proc.returncode == 0, proc.stderr
    line = first_launch_line(proc.stdout)
    assert "--limit-mm-per-prompt '{\"image\":2,\"video\":0}'" in line
    assert "--mm-processor-cache-gb 0" in line
    assert "2 image(s) of 4096x4096 px" in proc.stdout
