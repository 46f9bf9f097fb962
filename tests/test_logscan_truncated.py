"""Pool dumps cut short: parsed, attributed to their writer and reported, never dropped.

The cut logs are made from the real two-rank fixture `ms_rank_dir` (MindSpore 2.10, best-fit
pool): rank 0 is pid 10537 (actual peak 128 MiB), rank 1 is pid 10559 (actual peak 512 MiB).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pretuner.logscan import LogFollower, scan_paths
from pretuner.logscan.lines import parse_line, split_writers
from pretuner.logscan.pooldump import PartialPoolDump, PoolDump, PoolDumpHeader, PoolFormat
from pretuner.logscan.result import Truncation
from tests.test_logscan_scanner import scan_file

RANK_DIR = Path(__file__).parent / "fixtures" / "logs" / "ms_rank_dir"
RANK_LOGS = {
    0: RANK_DIR / "rank_0" / "logs" / "mindspore.vm.root.log.INFO.20261121-120646.10537",
    1: RANK_DIR / "rank_1" / "logs" / "mindspore.vm.root.log.INFO.20261121-120649.10559",
}
PIDS = {0: 10537, 1: 10559}
HEADER_LINE = 7  # `Common mem pool info: ...`, 1-based, in both rank logs
SUMMARY_LINE = 8  # `The dynamic memory pool total allocated mem:...`


def real_lines(rank: int) -> list[bytes]:
    return RANK_LOGS[rank].read_bytes().splitlines(keepends=True)


def cut_at(data: bytes, marker: bytes) -> bytes:
    """`data` up to, not including, the first `marker` (a writer killed right there)."""
    return data[: data.index(marker)]


def summary_text(rank: int) -> str:
    return real_lines(rank)[SUMMARY_LINE - 1].decode().rstrip("\n")


def cut_rank_dir(tmp_path: Path, cuts: dict[int, bytes]) -> Path:
    """A copy of the real rank folder in which each rank of `cuts` has only that log."""
    folder = tmp_path / "ms_rank_dir"
    shutil.copytree(RANK_DIR, folder, symlinks=True)
    for rank, data in cuts.items():
        (folder / RANK_LOGS[rank].relative_to(RANK_DIR)).write_bytes(data)
    return folder


def cut_in_summary(rank: int) -> bytes:
    """The rank's log, cut inside its summary line, just before `actual peak used`."""
    return cut_at(b"".join(real_lines(rank)), b"actual peak used")


def cut_after_header(rank: int) -> bytes:
    """The rank's log, cut after its `Common mem pool info` line: no summary line at all."""
    return b"".join(real_lines(rank)[:HEADER_LINE])


@pytest.mark.parametrize(
    ("marker", "peak_used_mib"),
    [
        pytest.param("actual peak used", 128.0, id="before-actual-peak"),
        pytest.param("mem:128M, in used", 128.0, id="inside-actual-peak"),
        pytest.param("28M, in used", 128.0, id="inside-the-number"),
        pytest.param(" peak used mem", None, id="before-peak-used"),
        pytest.param(" total allocated", None, id="right-after-the-start"),
    ],
)
def test_real_summary_cut_is_partial(marker: str, peak_used_mib: float | None) -> None:
    line = summary_text(0)
    assert isinstance(parse_line(line), PoolDump)
    event = parse_line(line[: line.index(marker)])
    assert event == PartialPoolDump(PoolFormat.BEST_FIT, None, peak_used_mib, False)


STAT = (
    '{"in used mem":28688.13MB,"peak used mem":29331.56MB,"alloc mem":29696.00MB,'
    '"idle mem":1007.86MB,"used by event mem":0.00MB,"eager free mem":0.00MB}'
)


@pytest.mark.parametrize(
    ("text", "fmt", "pool"),
    [
        pytest.param(
            f"The dynamic memory pool stat info : {STAT}, actu",
            PoolFormat.STAT_JSON,
            None,
            id="2.5",
        ),
        pytest.param(
            f"The dynamic memory pool[DefaultAscendMemoryPool] stat info : {STAT[:60]}",
            PoolFormat.NAMED_POOL,
            "DefaultAscendMemoryPool",
            id="2.6",
        ),
        pytest.param(
            "[MS_RUNTIME_PROF]The dynamic memory pool total allocated mem:10M, min ",
            PoolFormat.BEST_FIT,
            None,
            id="prof",
        ),
    ],
)
def test_every_format_cut_is_partial(text: str, fmt: PoolFormat, pool: str | None) -> None:
    event = parse_line(text)
    assert isinstance(event, PartialPoolDump)
    assert (event.format, event.pool_name) == (fmt, pool)
    assert event.profiled == text.startswith("[MS_RUNTIME_PROF]")


@pytest.mark.parametrize(
    "text",
    [
        "The dynamic memory pool total size is: 1024M, total used size is 4M",  # no dump: 1.x
        f"The dynamic memory pool stat info : {STAT}",  # the debug dump, complete, no peak
    ],
)
def test_lines_that_never_carry_a_peak_are_not_cut_dumps(text: str) -> None:
    assert parse_line(text) is None


def test_real_header_line() -> None:
    header = real_lines(1)[HEADER_LINE - 1]
    assert parse_line(header) == PoolDumpHeader("Common", profiled=False)
    assert parse_line(b"[MS_RUNTIME_PROF]Persistent mem pool info: Total allocated mem:0M") == (
        PoolDumpHeader("Persistent", profiled=True)
    )


def test_split_writers_keeps_each_writer_and_its_vllm_tag() -> None:
    cut = cut_at(real_lines(1)[SUMMARY_LINE - 1], b"actual peak used")
    whole = real_lines(0)[SUMMARY_LINE - 1].rstrip(b"\n")
    tag = b"(VllmWorker rank=0 pid=10537) "
    assert split_writers(cut + whole) == [cut, whole]
    assert split_writers(tag + cut + tag + whole) == [tag + cut, tag + whole]
    assert split_writers(tag + whole) == [tag + whole]


def test_rank_folder_cut_in_summary(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {1: cut_in_summary(1)})
    result = scan_paths([folder])
    assert [(r.rank, r.pid, r.actual_peak_mib, r.truncated_dumps) for r in result.ranks] == [
        (0, PIDS[0], 128, 0),
        (1, PIDS[1], None, 1),
    ]
    [cut] = result.truncated
    assert (cut.how, cut.rank, cut.pid, cut.line) == (Truncation.SUMMARY_CUT, 1, PIDS[1], 8)
    assert cut.file.endswith(".10559")
    assert cut.peak_used_mib == 512.0
    assert result.ranks[1].file == cut.file  # the rank points at its cut dump
    assert result.worst is not None
    assert result.worst.rank == 0
    doc = result.to_json()
    assert doc["truncated"][0]["pid"] == PIDS[1]
    assert doc["truncated"][0]["how"] == "summary_cut"
    assert "at least 512 MiB" in doc["truncated"][0]["message"]
    assert [r["truncated_dumps"] for r in doc["ranks"]] == [0, 1]


def test_rank_folder_cut_after_header(tmp_path: Path) -> None:
    folder = cut_rank_dir(tmp_path, {0: cut_after_header(0)})
    result = scan_paths([folder])
    [cut] = result.truncated
    assert (cut.how, cut.rank, cut.pid, cut.line) == (Truncation.SUMMARY_MISSING, 0, PIDS[0], 7)
    assert cut.peak_used_mib is None
    assert "rank 0 (pid 10537)" in cut.describe()
    assert "\n" not in cut.describe()
    assert [(r.rank, r.actual_peak_mib) for r in result.ranks] == [(0, None), (1, 512)]


def test_shared_log_with_a_writer_killed_mid_line(tmp_path: Path) -> None:
    """One stderr for both ranks: pid 10559 dies mid-summary, pid 10537's line runs on."""
    one, zero = real_lines(1), real_lines(0)
    data = b"".join(
        [
            *one[4 : SUMMARY_LINE - 1],
            *zero[4 : SUMMARY_LINE - 1],
            cut_at(one[SUMMARY_LINE - 1], b"actual peak used"),
            *zero[SUMMARY_LINE - 1 :],
        ]
    )
    log = tmp_path / "server.log"
    log.write_bytes(data)
    result = scan_paths([log])
    assert [(r.pid, r.actual_peak_mib, r.truncated_dumps) for r in result.ranks] == [
        (PIDS[0], 128, 0),
        (PIDS[1], None, 1),
    ]
    [cut] = result.truncated
    assert (cut.pid, cut.rank, cut.line) == (PIDS[1], None, 7)
    expected = [
        (3, PIDS[1], PoolDumpHeader),
        (6, PIDS[0], PoolDumpHeader),
        (7, PIDS[1], PartialPoolDump),
        (7, PIDS[0], PoolDump),
    ]
    scanned, _ = scan_file(log)
    assert [(e.line, e.pid, type(e.event)) for e in scanned] == expected
    followed = LogFollower(log).poll(final=True)
    assert [(e.line, e.pid, type(e.event)) for e in followed] == expected


def test_log_ending_inside_the_dump_is_followed_too(tmp_path: Path) -> None:
    log = tmp_path / "rank_1" / "server.log"
    log.parent.mkdir()
    log.write_bytes(cut_in_summary(1))
    follower = LogFollower(log)
    assert [type(e.event) for e in follower.poll()] == [PoolDumpHeader]  # last line pending
    [last] = follower.poll(final=True)
    assert isinstance(last.event, PartialPoolDump)
    assert (last.line, last.pid, last.rank) == (SUMMARY_LINE, PIDS[1], 1)


def test_complete_real_dumps_are_never_truncated() -> None:
    logs = sorted((RANK_DIR.parent).glob("*.log")) + [RANK_DIR]
    for log in logs:
        result = scan_paths([log])
        assert result.truncated == (), log
        assert all(r.truncated_dumps == 0 for r in result.ranks), log
