"""Issue 14 items 6-7: every bad value is refused at the edge, exit 2, one line, no folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pretuner.devices.base import decode_output
from pretuner.devices.npu_smi import parse_npu_smi
from pretuner.errors import BadInputError
from pretuner.logscan import scan_paths
from pretuner.logscan.lines import parse_line, parse_origin
from pretuner.method import MAX_NUM_SEQS, max_num_seqs
from pretuner.tune.entry import RunOptions
from pretuner.tune.record import RunRecord
from tests.helpers import invoke

BAD_RUN_FLAGS = [
    (["--serve-cmd", "serve 'unbalanced"], "--serve-cmd"),
    (["--serve-cmd", "  "], "--serve-cmd"),
    (["--headroom-gb", "nan"], "--headroom-gb nan"),
    (["--headroom-gb", "inf"], "--headroom-gb inf"),
    (["--headroom-gb", "-100"], "--headroom-gb -100"),
    (["--reserve-gb", "nan"], "--reserve-gb nan"),
    (["--reserve-gb", "-5"], "--reserve-gb -5"),
    (["--util", "nan"], "--util nan"),
    (["--ready-timeout", "inf"], "--ready-timeout inf"),
    (["--stop-grace", "nan"], "--stop-grace nan"),
    (["--stop-grace", "-1"], "--stop-grace -1"),
    (["--block-size", "7"], "--block-size 7"),
    (["--kv-cache-dtype", "foo"], "'--kv-cache-dtype': Value error, 'foo' is not one of"),
    (["--pp", "0"], "--pp 0"),
    (["--tp", "0"], "--tp 0"),
    (["--card", "1000000000"], "--card 1000000000"),
    (["--out", ""], "--out ''"),
    (["--out", "   "], "--out"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_RUN_FLAGS)
def test_run_refuses_bad_flags_before_any_folder(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    done = invoke("run", "--model", "tiny-mla", "--card", "64", *flags, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("pretuner: error: ")
    assert named in line
    assert list(tmp_path.iterdir()) == []  # no run folder, no journal in the current folder


@pytest.mark.parametrize(
    "flags",
    [["--kv-gib", "nan"], ["--kv-gib", "inf"], ["--headroom-gb", "nan"], ["--util", "inf"],
     ["--block-size", "7"], ["--card", "100000"]],
)  # fmt: skip
def test_plan_refuses_non_finite_and_odd_values(flags: list[str]) -> None:
    done = invoke("plan", "--model", "tiny-mla", "--card", "64", *flags)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert flags[0] in done.stderr


# Issue 26: `plan --engine vllm` turned these into exit 4 "infeasible"; both commands refuse
# them alike (the same exit 2 and the same line), on a V1 engine and on r0.1.
BAD_PLAN_AND_RUN = [
    pytest.param(["--gpu-memory-utilization", "95"], "--util 95.0 is outside (0, 1]", id="util"),
    pytest.param(["--card", "0"], "card size 0 GiB is invalid", id="card-0"),
    pytest.param(["--block-size", "17"], "--block-size 17 is not supported", id="block-17"),
    pytest.param(["--max-model-len", "0"], "--max-model-len 0 is invalid", id="len-0"),
    pytest.param(["--engine", "vllm-gpu"], "unknown engine 'vllm-gpu'", id="engine"),
    pytest.param(["--tp", "0"], "--tp 0 is invalid", id="tp-0"),
    pytest.param(["--headroom-gb", "-1"], "--headroom-gb -1.0 is negative", id="headroom"),
    pytest.param(["--quantization", "awq"], "no quantization_config", id="awq-on-bf16"),
    pytest.param(["--cpu-offload-gb", "-1"], "--cpu-offload-gb -1.0 is negative", id="offload"),
    pytest.param(["--limit-mm-per-prompt", "image=2"], "is a text model", id="text-model-images"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "says"), BAD_PLAN_AND_RUN)
@pytest.mark.parametrize("engine", ["vllm", "auto"])
def test_plan_refuses_bad_input_as_run_does(flags: list[str], says: str, engine: str) -> None:
    argv = ["--model", "qwen3-8b", "--card", "80", "--engine", engine, "--emulate", *flags]
    if "--engine" in flags:
        argv = ["--model", "qwen3-8b", "--card", "80", *flags]
    ran = invoke("run", *argv, "--dry-run")
    planned = invoke("plan", *argv)
    assert (planned.returncode, planned.stderr) == (ran.returncode, ran.stderr)
    assert planned.returncode == 2
    [line] = planned.stderr.strip().splitlines()
    assert line.startswith("pretuner: error: ")
    if engine == "vllm" or "--engine" in flags:  # r0.1 refuses V1 flags first, in its own words
        assert says in line


def _journal(folder: Path, *lines: str) -> Path:
    folder.mkdir()
    (folder / "journal.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def _started(options: object, **extra: object) -> str:
    """A journal's first line; `options` any JSON value (a damaged journal's too)."""
    return json.dumps({"event": "run_started", "time": 0, "options": options, **extra})


def test_resume_refuses_flags_and_dry_run(tmp_path: Path) -> None:
    run = _journal(tmp_path / "r", _started({"model": "tiny-mla"}))
    done = invoke("run", "--resume", str(run), "--headroom-gb", "1", "--card", "64")
    assert done.returncode == 2
    assert "cannot be given with --resume" in done.stderr
    assert "--card" in done.stderr
    assert "--headroom-gb" in done.stderr
    done = invoke("run", "--dry-run", "--resume", str(run))
    assert done.returncode == 2
    assert "--dry-run cannot be combined with --resume" in done.stderr
    assert "config.json" not in done.stderr


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (_started({"model": "tiny-mla", "turbo": 1}, version="9.9"), "'turbo'"),
        (_started({"model": "tiny-mla", "card_gib": "64"}), "card_gib = '64'"),
        (_started({"model": "tiny-mla", "block_size": 7}), "--block-size 7"),
        (_started(["tiny-mla"]), "not an object"),
        ("[1, 2, 3]", "line 1 is not a journal event"),
        ('{"no_event": 1}', "line 1 is not a journal event"),
    ],
)
def test_resume_refuses_a_damaged_or_foreign_journal(tmp_path: Path, line: str, named: str) -> None:
    run = _journal(tmp_path / "r", line)
    done = invoke("run", "--resume", str(run))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert named in done.stderr
    if "turbo" in named:
        assert "pretuner 9.9" in done.stderr


def test_journal_skips_a_cut_line_and_reads_non_utf8(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "journal.jsonl").write_bytes(
        _started({"model": "tiny-mla"}).encode() + b'\n{"event": "lau\xff\n{"event": "x"}\n'
    )
    assert [e["event"] for e in RunRecord.open(run).events] == ["run_started", "x"]


@pytest.mark.parametrize(
    "bad",
    [
        {"headroom_gib": float("nan")},
        {"reserve_gib": -5.0},
        {"block_size": 7},
        {"kv_cache_dtype": "foo"},
        {"pp": 0},
        {"card_gib": 10**9},
        {"out": ""},
        {"serve_cmd": "a 'b"},
        {"request_timeout_s": float("inf")},
        {"model": ""},
    ],
)
def test_run_options_check_for_library_callers(bad: dict[str, Any]) -> None:
    with pytest.raises(BadInputError):
        RunOptions(**{"model": "tiny-mla", **bad}).check()


def test_run_options_from_json_round_trip() -> None:
    opts = RunOptions(model="tiny-mla", headroom_gib=1.5, sim_env={"A": "b"})
    assert RunOptions.from_json(opts.to_json()) == opts


@pytest.mark.parametrize("digits", [309, 4301, 16000])  # longer lines are cut at 16 KiB
def test_huge_figures_are_skipped_not_raised(tmp_path: Path, digits: int) -> None:
    big = "9" * digits
    lines = [
        f"[INFO] PRE_ACT(1,7f,python):x The dynamic memory pool total allocated mem:1M, "
        f"in used mem:1M, peak used mem:1M, actual peak used mem:{big}M.",
        f"[INFO] PRE_ACT({big},7f,python):x The dynamic memory pool total allocated mem:1M, "
        "in used mem:1M, peak used mem:1M, actual peak used mem:5M.",
        f"INFO GPU KV cache size: {big} tokens",
        f"INFO Model loading took {big}.5 GiB and 3.0 s",
        f"Memory isn't enough and alloc failed, kernel name: k, alloc size: {big}B",
    ]
    assert parse_line(lines[0]) is None
    assert parse_origin(lines[1]).pid is None
    for line in lines[2:]:
        assert parse_line(line) is None
    (tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    result = scan_paths([tmp_path])
    assert result.worst is not None
    assert result.worst.actual_peak_mib == 5
    done = invoke("scan", str(tmp_path))
    assert done.returncode == 0, done.stderr


def test_npu_smi_garbage_bytes_and_figures() -> None:
    text = decode_output(b"+---\n| 0  910B3 \xff\xfe | OK |\n")
    assert "\ufffd" in text
    assert parse_npu_smi(text) == ()
    row = "| 0     910B3               | OK            | 93.1        45                0    / 0  |"
    chip = "| 0                         | 0000:C1:00.0  | 0           0    / 0          {u} / {t} |"
    sane = parse_npu_smi("\n".join([row, chip.format(u=3402, t=65536)]))
    assert [c.hbm_total_mib for c in sane] == [65536]
    assert parse_npu_smi("\n".join([row, chip.format(u=3402, t="9" * 5000)])) == ()


def test_max_num_seqs_has_a_sanity_cap() -> None:
    assert max_num_seqs(10**12, 16, 16, 0.0) == MAX_NUM_SEQS
