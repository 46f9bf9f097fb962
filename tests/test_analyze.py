"""`pretuner analyze`: the manual method on existing logs, through the console entry point."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.helpers import invoke

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
PREFIX = "[INFO] PRE_ACT({pid},7f3a2b1c0700,python):2025-05-16-23:06:54.123.456 "
DUMP_25 = (
    "[mindspore/ccsrc/memory/mem_pool/abstract_dynamic_mem_pool.cc:1029] DumpDynamicMemPoolStateInfo] "
    'The dynamic memory pool stat info : {{"in used mem":28688.13MB,"peak used mem":29331.56MB,'
    '"alloc mem":29696.00MB,"idle mem":1007.86MB,"used by event mem":0.00MB,"eager free mem":0.00MB}}, '
    "actual peak used mem:{peak}M. Weight used size:0M, constant value used size:0M, "
    "kernel output used size:0M, other used size:28688M."
)
SEED_ARGS = ["--model", "deepseek-v3", "--card", "64", "--util", "0.9", "--model-use-gb", "50",
             "--max-model-len", "16384", "--tp", "1"]  # fmt: skip


def write_log(path: Path, peaks: dict[int, int], noise: int = 50) -> Path:
    lines = []
    for i in range(noise):
        lines.append(PREFIX.format(pid=1000) + f"[mindspore/ccsrc/x.cc:{i}] F] step {i}")
    for pid, peak in peaks.items():
        lines.append(PREFIX.format(pid=pid) + DUMP_25.format(peak=peak))
    path.write_text("\r\n".join(lines) + "\r\n")
    return path


def test_seed_worked_example(tmp_path: Path) -> None:
    log = write_log(tmp_path / "server.log", {4242: 29614})
    proc = invoke("analyze", str(log), *SEED_ARGS, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["actual_peak_mib"] == 29614
    assert data["kv_prerun_gib"] == pytest.approx(7.60, abs=0.005)
    assert data["weights_act_gib"] == pytest.approx(21.32, abs=0.005)
    assert data["max_kv_gib"] == pytest.approx(36.28, abs=0.005)
    assert 553_000 < data["max_kv_tokens"] < 555_000
    assert data["max_num_seqs_method"] == 33
    assert data["env"] == {"ASCEND_TOTAL_MEMORY_GB": "64", "vLLM_MODEL_MEMORY_USE_GB": "22"}
    assert data["flags"]["max_num_seqs"] == 33


def test_text_output_shows_every_step(tmp_path: Path) -> None:
    log = write_log(tmp_path / "server.log", {4242: 29614})
    proc = invoke("analyze", str(log), *SEED_ARGS)
    assert proc.returncode == 0, proc.stderr
    for fragment in ("1. KV cache in the pre-run", "= 7.60 GiB", "= 21.32 GiB", "= 36.28 GiB",
                     "5. max-num-seqs", "export vLLM_MODEL_MEMORY_USE_GB=22", "measured"):  # fmt: skip
        assert fragment in proc.stdout


def test_worst_rank_decides_and_tp_is_derived(tmp_path: Path) -> None:
    log = write_log(tmp_path / "server.log", {101: 29000, 102: 29614, 103: 29100, 104: 28900})
    args = [a for a in SEED_ARGS if a not in ("--tp", "1")]
    proc = invoke("analyze", str(log), *args, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["worst_rank"]["pid"] == 102
    assert data["tp"] == 4
    assert data["tp_source"] == "derived"
    assert len(data["ranks"]) == 4


def test_gzip_and_folder(tmp_path: Path) -> None:
    raw = write_log(tmp_path / "plain.log", {7: 29614}).read_bytes()
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "server.log.gz").write_bytes(gzip.compress(raw))
    proc = invoke("analyze", str(folder), *SEED_ARGS, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["actual_peak_mib"] == 29614


def test_real_mindspore_rank_folders() -> None:
    # Real MindSpore 2.10 per-rank folders (GLOG_log_dir + RANK_ID): rank 0 peaked at 128M,
    # rank 1 at 512M. A 2 GiB "card" at util 0.7 with model-use 1 GiB gave a 0.4 GiB pre-run KV.
    proc = invoke("analyze", str(FIXTURES / "ms_rank_dir"), "--model", "qwen3-8b", "--card", "2",
                  "--util", "0.7", "--model-use-gb", "1", "--max-model-len", "1024", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert sorted((r["rank"], r["actual_peak_mib"]) for r in data["ranks"]) == [(0, 128), (1, 512)]
    assert data["worst_rank"]["rank"] == 1
    assert data["tp"] == 2


def test_no_peak_line_explains_why(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO 05-16 23:06:54 api_server.py:1] started\n" * 20)
    proc = invoke("analyze", str(log), *SEED_ARGS)
    assert proc.returncode == 3
    assert "no `actual peak used` line" in proc.stderr
    assert "GLOG_v=1" in proc.stderr


def test_oom_log_is_refused_with_the_fallback(tmp_path: Path) -> None:
    proc = invoke("analyze", str(FIXTURES / "ms_cpu_oom.log"), *SEED_ARGS)
    assert proc.returncode == 4, proc.stderr
    assert "out-of-memory" in proc.stderr
    assert "raise vLLM_MODEL_MEMORY_USE_GB" in proc.stderr


def test_log_that_does_not_match_the_settings(tmp_path: Path) -> None:
    proc = invoke("analyze", str(FIXTURES / "ms_cpu_exit.log"), *SEED_ARGS)
    assert proc.returncode == 2
    assert "is not above the pre-run's KV cache" in proc.stderr


def test_out_file_written_once(tmp_path: Path) -> None:
    log = write_log(tmp_path / "server.log", {4242: 29614})
    out = tmp_path / "tuned.env"
    first = invoke("analyze", str(log), *SEED_ARGS, "--out", str(out))
    assert first.returncode == 0, first.stderr
    text = out.read_text()
    assert "vLLM_MODEL_MEMORY_USE_GB=22" in text
    assert "--max-num-seqs 33" in text
    second = invoke("analyze", str(log), *SEED_ARGS, "--out", str(out))
    assert second.returncode == 2
    assert "never overwrites" in second.stderr
    assert out.read_text() == text


def test_missing_path(tmp_path: Path) -> None:
    proc = invoke("analyze", str(tmp_path / "nope.log"), *SEED_ARGS)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


@pytest.mark.parametrize(("flags", "said"), [
    (["--util", "95"], "--util 95.0 is outside (0, 1]"),  # run's rule: analyze took it before
    (["--card", "0"], "card size 0 GiB is invalid"),
])
def test_the_layout_options_are_checked_as_run_checks_them(flags: list[str], said: str,
                                                            tmp_path: Path) -> None:
    log = write_log(tmp_path / "server.log", {4242: 29614})
    proc = invoke("analyze", str(log), "--model", "deepseek-v3", *flags)
    assert proc.returncode == 2
    assert said in proc.stderr


def test_pre_run_settings_not_given_are_said_as_assumed(tmp_path: Path) -> None:
    """The log does not say the pre-run's util, model-use or length: never silently assumed."""
    log = write_log(tmp_path / "server.log", {4242: 29614})
    base = ["--model", "deepseek-v3", "--card", "64", "--tp", "1"]
    text = invoke("analyze", str(log), *base)
    assert text.returncode == 0, text.stderr
    assert ("warning: assumed, not given: --util 0.9, --model-use-gb 50, --max-model-len 16384"
            in text.stdout)
    as_json = invoke("analyze", str(log), *base, "--util", "0.9", "--json")
    data = json.loads(as_json.stdout)
    assert data["assumed"] == {"--model-use-gb": 50, "--max-model-len": 16384}
    assert data["provenance"]["prerun_settings"] == "assumed"
    assert "assumed, not given: --model-use-gb 50" in as_json.stderr
    # The same figures as when they are given: the defaults are the method's.
    assert data["max_kv_tokens"] == json.loads(
        invoke("analyze", str(log), *SEED_ARGS, "--json").stdout)["max_kv_tokens"]
    given = invoke("analyze", str(log), *SEED_ARGS)
    assert "assumed" not in given.stdout
    assert "assumed" not in given.stderr
