"""File scanning: files, folders, gzip, rank attribution and robustness on real fixtures."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import pytest

from pretuner.errors import BadInputError
from pretuner.logscan import scan_paths
from pretuner.logscan.events import Located, LogEvent, OomKind
from pretuner.logscan.files import list_log_files, rank_from_path
from pretuner.logscan.pooldump import PoolDump
from pretuner.logscan.result import OomPhase
from pretuner.logscan.scanner import WINDOW_BYTES, FileDone, iter_scan

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
EXIT_LOG = FIXTURES / "ms_cpu_exit.log"
OOM_LOG = FIXTURES / "ms_cpu_oom.log"
RANK_DIR = FIXTURES / "ms_rank_dir"

DUMP = (
    b"[INFO] PRE_ACT(%d,7f44c3888b80,python):2026-11-21-12:00:09.706.878 "
    b"[mindspore/ccsrc/runtime/memory/mem_pool/mem_dynamic_allocator.cc:1211] "
    b"DumpDynamicMemPoolStateInfo] The dynamic memory pool total allocated mem:%dM, min addr :0,"
    b" max addr: 0, peak used mem:%dM, actual peak used mem:%dM, in used mem:4M, total used by "
    b"event mem:0M, total idle mem:1019M, total eager free mem:0M. Weight used size:0M, constant"
    b" value used size:0M, kernel output used size:0M, other used size:4M."
)
NOISE = (
    b"[INFO] COMMON(%d,7f44c3888b80,python):2026-11-21-12:00:09.709.637 "
    b"[mindspore/ccsrc/pybind_api/frontend/manager.cc:214] ClearResPart3] Start clear parallel"
)


def dump(pid: int, peak: int) -> bytes:
    return DUMP % (pid, peak + 512, peak, peak)


def noise(pid: int) -> bytes:
    return NOISE % pid


def scan_file(path: Path, *, workers: int | None = None) -> tuple[list[Located], FileDone]:
    """Every event of one file, held in memory, and its `FileDone`."""
    items = list(iter_scan([str(path)], workers=workers))
    done = items[-1]
    assert isinstance(done, FileDone)
    return [item for item in items if isinstance(item, Located)], done


def peak_mib(event: LogEvent) -> int:
    """A found event's actual peak: it must be a whole pool dump."""
    assert isinstance(event, PoolDump), event
    return event.actual_peak_mib


def test_real_exit_dump() -> None:
    result = scan_paths([EXIT_LOG])
    assert [r.actual_peak_mib for r in result.ranks] == [512]
    rank = result.ranks[0]
    assert rank.pid == 10320
    assert rank.rank is None
    assert rank.line == 8  # the line grep -n reports
    assert result.worst == rank
    assert result.oom == ()


def test_real_oom_is_classified_once() -> None:
    result = scan_paths([OOM_LOG])
    assert len(result.oom) == 1
    oom = result.oom[0]
    assert oom.kind is OomKind.DEVICE_OOM
    assert oom.phase is OomPhase.ACTIVATION
    assert oom.event.alloc_bytes == 6144000000
    assert oom.event.kernel == "0_Default/0-Dense/MatMul-op0"
    assert "isn't enough" in OOM_LOG.read_text().splitlines()[oom.line - 1]
    assert result.ranks[0].dumps == 2  # at the failure and at exit


def test_rank_folders_and_symlink_counted_once() -> None:
    result = scan_paths([RANK_DIR])
    assert [(r.rank, r.actual_peak_mib) for r in result.ranks] == [(0, 128), (1, 512)]
    assert result.worst is not None
    assert result.worst.rank == 1
    assert not any(f.endswith("mindspore.INFO") for f in result.files)
    assert all(r.dumps == 1 for r in result.ranks)


def test_symlink_given_alone_is_read(tmp_path: Path) -> None:
    link = tmp_path / "mindspore.INFO"
    link.symlink_to(EXIT_LOG.resolve())
    assert scan_paths([link]).ranks[0].actual_peak_mib == 512


def test_rank_from_path() -> None:
    assert rank_from_path("D/rank_7/logs/mindspore.h.u.log.INFO.20250101-000000.42") == 7
    assert rank_from_path("logs/worker_rank3.log") == 3
    assert rank_from_path("logs/server.log") is None


def test_gzip_and_plain_agree(tmp_path: Path) -> None:
    target = tmp_path / "server.log.gz"
    target.write_bytes(gzip.compress(OOM_LOG.read_bytes()))
    plain = scan_paths([OOM_LOG])
    packed = scan_paths([target])
    assert [(o.kind, o.line) for o in packed.oom] == [(o.kind, o.line) for o in plain.oom]
    assert packed.lines_scanned == plain.lines_scanned


def test_a_text_file_that_starts_like_gzip_is_read_as_text(tmp_path: Path) -> None:
    """Rule: gzip's two magic bytes alone do not make a stream (found by the fuzz test: the
    scan saw nothing where the live follower saw the dump); nothing decompresses: text."""
    target = tmp_path / "server.log"
    target.write_bytes(b"\x1f\x8b\n" + b"\n".join([noise(5), dump(5, 900), noise(5)]) + b"\n")
    result = scan_paths([target])
    assert result.ranks[0].actual_peak_mib == 900
    assert result.unreadable == ()


def test_truncated_gzip_keeps_what_was_read(tmp_path: Path) -> None:
    data = b"".join(noise(5) + b"\n" for _ in range(2000)) + dump(5, 900) + b"\n"
    data += b"".join(noise(5) + b"\n" for _ in range(20000))
    packed = gzip.compress(data)
    target = tmp_path / "cut.log.gz"
    target.write_bytes(packed[: len(packed) * 3 // 4])
    result = scan_paths([target])
    assert result.ranks[0].actual_peak_mib == 900
    assert [u.file for u in result.unreadable] == [str(target)]


def test_pids_are_ranks_and_max_dump_wins(tmp_path: Path) -> None:
    lines = [noise(11), dump(11, 300), noise(22), dump(22, 700), dump(11, 450), noise(11)]
    (tmp_path / "server.log").write_bytes(b"\n".join(lines) + b"\n")
    result = scan_paths([tmp_path])
    assert [(r.pid, r.actual_peak_mib, r.line) for r in result.ranks] == [
        (11, 450, 5),
        (22, 700, 4),
    ]
    assert result.worst is not None
    assert result.worst.pid == 22


def test_vllm_rank_tag_names_the_mindspore_pid(tmp_path: Path) -> None:
    lines = [
        b"(VllmWorker rank=1 pid=77) INFO 05-16 23:06:54 [gpu_worker.py:1] "
        b"Available KV cache memory: 12.50 GiB",
        b"(VllmWorker rank=0 pid=66) INFO 05-16 23:06:54 [gpu_worker.py:1] "
        b"Available KV cache memory: 13.00 GiB",
        b"INFO 05-16 23:06:55 [kv_cache_utils.py:1] GPU KV cache size: 645,120 tokens",
        dump(77, 30000),
        dump(66, 29000),
    ]
    (tmp_path / "server.log").write_bytes(b"\r\n".join(lines) + b"\r\n")
    result = scan_paths([tmp_path / "server.log"])
    assert [(r.rank, r.pid, r.actual_peak_mib) for r in result.ranks] == [
        (0, 66, 29000),
        (1, 77, 30000),
    ]
    assert result.available_kv_gib == 12.5
    assert result.kv_cache_tokens == 645120


def test_missing_path_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="nope.log"):
        scan_paths([tmp_path / "nope.log"])


def test_unreadable_file_is_reported(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    target = tmp_path / "secret.log"
    target.write_bytes(dump(1, 10))
    target.chmod(0)
    result = scan_paths([target])
    assert result.unreadable


def test_dangling_symlink_in_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / "mindspore.INFO").symlink_to(tmp_path / "gone.log")
    shutil.copy(EXIT_LOG, tmp_path / "a.log")
    result = scan_paths([tmp_path])
    assert result.ranks[0].actual_peak_mib == 512
    assert [u.file for u in result.unreadable] == [str(tmp_path / "mindspore.INFO")]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff\xfe" * 5000,
        bytes(range(256)) * 64,
        b"\r\r\r\n\n\x1b[31m" * 1000,
        b"actual peak used " * 300,
    ],
)
def test_garbage_around_real_lines(tmp_path: Path, garbage: bytes) -> None:
    data = garbage + b"\n" + dump(9, 321) + b"\r\n" + garbage + b"\n" + dump(9, 123)
    (tmp_path / "mixed.log").write_bytes(data)  # the last line has no newline
    result = scan_paths([tmp_path])
    assert result.ranks[0].actual_peak_mib == 321
    assert result.ranks[0].dumps == 2


@pytest.mark.slow
def test_huge_line_and_window_boundaries(tmp_path: Path) -> None:
    """A 20 MiB line crosses the mmap window; dumps on both sides are found with line numbers."""
    huge = b"x" * (WINDOW_BYTES + 4 * 2**20)
    filler = b"\n".join(noise(3) for _ in range(100_000))
    data = dump(3, 10) + b"\n" + huge + b"\n" + filler + b"\n" + dump(3, 99) + b"\n"
    (tmp_path / "big.log").write_bytes(data)
    events, done = scan_file(tmp_path / "big.log", workers=1)
    assert [(e.line, peak_mib(e.event)) for e in events] == [
        (1, 10),
        (100_003, 99),
    ]
    assert done.lines == 100_003


def test_parallel_segments_match_sequential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pretuner.logscan import scanner

    monkeypatch.setattr(scanner, "PARALLEL_MIN_BYTES", 64 * 1024)
    block = b"\n".join(noise(4) for _ in range(997))
    parts = [block + b"\n" + dump(4, 100 + i) + b"\n" for i in range(40)]
    (tmp_path / "a.log").write_bytes(b"".join(parts))
    sequential, seq_done = scan_file(tmp_path / "a.log", workers=1)
    parallel, par_done = scan_file(tmp_path / "a.log", workers=2)
    assert [e.line for e in parallel] == [e.line for e in sequential]
    assert [e.line for e in sequential] == [998 * (i + 1) for i in range(40)]
    assert par_done.lines == seq_done.lines


def test_list_log_files_orders_and_dedups(tmp_path: Path) -> None:
    shutil.copytree(RANK_DIR, tmp_path / "logs", symlinks=True)
    found = [Path(f).name for f in list_log_files([tmp_path])[0]]
    assert "mindspore.INFO" not in found
    assert len(found) == 4
