"""Find the memory lines in log files at grep speed, with bounded memory.

Plain files are read through 16 MiB `mmap` windows that end on a line boundary, so memory
stays flat whatever the file size; `search` finds the anchor lines of each window in one
vectorised pass, and only those lines are decoded and parsed. Large files are cut at line
boundaries into segments that worker processes scan in parallel.

Events are streamed (`iter_scan`), never collected: whatever the number of matched lines, a
worker keeps at most SPILL_BYTES of them in memory and spools the rest to a temporary file,
and at most two segments per worker are in flight.
"""

from __future__ import annotations

import gzip
import mmap
import os
import struct
import tempfile
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretuner.logscan.events import Located
from pretuner.logscan.files import rank_from_path
from pretuner.logscan.lines import locate_line
from pretuner.logscan.search import find_anchor_lines, hit_bytes

if TYPE_CHECKING:
    from concurrent.futures import Future

WINDOW_BYTES = 16 * 2**20  # bytes mapped at a time: bounds the resident set
BATCH_BYTES = 2 * 2**20  # of a window searched at a time: bounds the hit lines held
# Smaller inputs are scanned in this process: starting the pool (its imports and forks, some
# 30 ms) costs about what a second core saves on 128 MiB (0.5 s/GiB on one core).
PARALLEL_MIN_BYTES = 128 * 2**20
SPILL_BYTES = 2**20  # matched lines a worker holds before it spools them to a file
_RECORD = struct.Struct("<QI")  # a spooled hit: line index, byte length; then the bytes


@dataclass(frozen=True, slots=True)
class FileStart:
    """The events that follow are of this file."""

    file: str
    rank: int | None  # from a rank_<N> folder or file name


@dataclass(frozen=True, slots=True)
class FileDone:
    """The end of one file's events, with what reading it took."""

    file: str
    rank: int | None
    lines: int
    bytes_read: int
    error: str | None


ScanItem = Located | FileStart | FileDone


@dataclass(frozen=True, slots=True)
class _Job:
    """[start, end) of a plain file (both ends line boundaries), or a whole gzip stream."""

    file: str
    start: int
    end: int
    gzip: bool


@dataclass(slots=True)
class _Progress:
    """How far a job got: filled in while its hits are read."""

    newlines: int = 0
    bytes_read: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class _SegmentHits:
    """A worker's answer: its first hits, the rest spooled to a file (deleted once read)."""

    lines: tuple[tuple[int, bytes], ...]  # (line index from segment start, 0-based; bytes)
    spool: str | None
    progress: _Progress


def _batches(job: _Job, progress: _Progress) -> Iterator[list[tuple[int, bytes]]]:
    """The hit lines of a job, one window (or gzip batch) at a time."""
    return _gzip_or_text(job.file, progress) if job.gzip else _plain_batches(job, progress)


def _gzip_or_text(path: str, progress: _Progress) -> Iterator[list[tuple[int, bytes]]]:
    """A gzip stream; a file that only starts with gzip's two magic bytes (nothing in it
    decompresses) is text, read as the live follower reads it."""
    yield from _gzip_batches(path, progress)
    if progress.bytes_read == 0 and progress.error is not None:
        progress.error = None
        try:
            size = os.path.getsize(path)
        except OSError as err:
            progress.error = f"cannot read {path}: {err}"
            return
        yield from _plain_batches(_Job(path, 0, size, False), progress)


def _plain_batches(job: _Job, progress: _Progress) -> Iterator[list[tuple[int, bytes]]]:
    pos = job.start
    try:
        with open(job.file, "rb") as handle:
            while pos < job.end:
                map_at = pos - pos % mmap.ALLOCATIONGRANULARITY
                length = min(WINDOW_BYTES, job.end - map_at)
                window = mmap.mmap(handle.fileno(), length, offset=map_at, access=mmap.ACCESS_READ)
                try:
                    first = pos - map_at
                    if map_at + length >= job.end:
                        last = length
                    else:
                        last = window.rfind(b"\n", first, length) + 1
                        if last <= first:  # a line longer than the window: cut it
                            last = length
                    yield from _window_batches(window, first, last, progress)
                finally:
                    window.close()
                pos = map_at + last
                progress.bytes_read = pos - job.start
    except (OSError, ValueError) as err:
        progress.error = f"read error: {err}"
        progress.bytes_read = pos - job.start


def _window_batches(
    window: mmap.mmap, first: int, last: int, progress: _Progress
) -> Iterator[list[tuple[int, bytes]]]:
    """The hits of window[first:last], BATCH_BYTES at a time: what is held stays small."""
    a = first
    while a < last:
        b = last
        if last - a > BATCH_BYTES:
            b = window.find(b"\n", a + BATCH_BYTES, last) + 1 or last
        yield _hits(window, a, b, progress)
        a = b


def _hits(buf: bytes | bytearray | mmap.mmap, start: int, end: int,
          progress: _Progress) -> list[tuple[int, bytes]]:
    """The hit lines of buf[start:end], numbered on from the lines `progress` counted."""
    hits, count = find_anchor_lines(buf, start, end)
    base = progress.newlines
    progress.newlines += count
    return [(base + before, hit_bytes(buf, a, b, hit)) for a, b, hit, before in hits]


def _gzip_batches(path: str, progress: _Progress) -> Iterator[list[tuple[int, bytes]]]:
    """A compressed file through a bounded buffer; keeps what was read before an error."""
    piece = 256 * 2**10  # small reads: a truncated stream loses at most one piece
    batch = 4 * 2**20
    buf = bytearray()
    try:
        with gzip.open(path, "rb") as stream:
            while data := stream.read(piece):
                progress.bytes_read += len(data)
                buf += data
                if len(buf) >= batch:
                    last = buf.rfind(b"\n") + 1
                    # A line longer than four batches is cut rather than held.
                    cut = last if last else len(buf) if len(buf) >= 4 * batch else 0
                    if cut:
                        yield _hits(buf, 0, cut, progress)
                        del buf[:cut]
    except (OSError, EOFError, zlib.error) as err:
        progress.error = f"decompression stopped after {progress.bytes_read:,} bytes: {err}"
    if buf:
        yield _hits(buf, 0, len(buf), progress)


def _scan_job(job: _Job, spool_dir: str) -> _SegmentHits:
    """A worker's scan of one job: past SPILL_BYTES, the hits go to a file in `spool_dir`."""
    progress = _Progress()
    kept: list[tuple[int, bytes]] = []
    held = 0
    spool: str | None = None
    out = None
    try:
        for batch in _batches(job, progress):
            if out is None:
                kept += batch
                held += sum(len(raw) + 64 for _, raw in batch)
                if held <= SPILL_BYTES:
                    continue
                fd, spool = tempfile.mkstemp(dir=spool_dir, suffix=".hits")
                out = os.fdopen(fd, "wb")
                batch, kept = kept, []
            for index, raw in batch:
                out.write(_RECORD.pack(index, len(raw)))
                out.write(raw)
    except OSError as err:  # the spool's disk is full: report what was kept as unreadable
        progress.error = f"cannot spool the matched lines to {spool_dir}: {err}"
    finally:
        if out is not None:
            out.close()
    return _SegmentHits(tuple(kept), spool, progress)


def _read_hits(result: _SegmentHits) -> Iterator[tuple[int, bytes]]:
    yield from result.lines
    if result.spool is None:
        return
    try:
        with open(result.spool, "rb") as spooled:
            while len(head := spooled.read(_RECORD.size)) == _RECORD.size:  # a cut write: stop
                index, length = _RECORD.unpack(head)
                yield index, spooled.read(length)
    finally:
        os.unlink(result.spool)


def _is_gzip(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def _split_points(path: str, size: int, parts: int) -> list[int]:
    """Cut a file into `parts` ranges whose ends are line starts."""
    points = [0]
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for k in range(1, parts):
            target = size * k // parts
            newline = mm.find(b"\n", target - 1, min(size, target + WINDOW_BYTES))
            cut = newline + 1 if newline >= 0 else size  # a line longer than a window: no cut
            if cut > points[-1]:
                points.append(cut)
    points.append(size)
    return sorted(set(points))


def _plan(files: Sequence[str], cpus: int) -> tuple[list[tuple[str, list[_Job]]], bool]:
    """The jobs of each file, and whether workers should run them."""
    plan: list[tuple[str, list[_Job]]] = []
    total = 0
    for file in files:
        try:
            size = os.path.getsize(file)
        except OSError:
            size = 0
        total += size
        gz = _is_gzip(file)
        plan.append((file, [_Job(file, 0, -1 if gz else size, gz)]))
    parallel = cpus > 1 and total >= PARALLEL_MIN_BYTES
    if parallel:
        piece = max(PARALLEL_MIN_BYTES // 2, total // (cpus * 2))
        for i, (file, [job]) in enumerate(plan):
            if not job.gzip and job.end > piece:
                points = _split_points(file, job.end, min(cpus * 2, max(2, job.end // piece)))
                jobs = [_Job(file, a, b, False) for a, b in zip(points, points[1:], strict=False)]
                plan[i] = (file, jobs)
    return plan, parallel


def iter_scan(files: Sequence[str], *, workers: int | None = None) -> Iterator[ScanItem]:
    """Each file's events in order, between its `FileStart` and `FileDone` (plain or gzip)."""
    cpus = workers if workers is not None else (os.cpu_count() or 1)
    plan, parallel = _plan(files, cpus)
    if not parallel:
        for file, jobs in plan:
            yield from _file_items(file, (_in_process(job) for job in jobs))
        return
    # Imported here: a scan that needs no workers (most logs) does not pay for them.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with (
        tempfile.TemporaryDirectory(prefix="pretuner-scan-") as spool_dir,
        ProcessPoolExecutor(max_workers=cpus, mp_context=context) as pool,
    ):
        queue = iter([job for _, jobs in plan for job in jobs])
        pending: deque[Future[_SegmentHits]] = deque()

        def results(count: int) -> Iterator[tuple[Iterable[tuple[int, bytes]], _Progress]]:
            # Results are read in submission order; two per worker are in flight at most.
            for _ in range(count):
                while len(pending) < 2 * cpus and (job := next(queue, None)) is not None:
                    pending.append(pool.submit(_scan_job, job, spool_dir))
                result = pending.popleft().result()
                yield _read_hits(result), result.progress

        for file, jobs in plan:
            yield from _file_items(file, results(len(jobs)))


def _in_process(job: _Job) -> tuple[Iterable[tuple[int, bytes]], _Progress]:
    progress = _Progress()
    return (hit for batch in _batches(job, progress) for hit in batch), progress


def _file_items(
    file: str, parts: Iterable[tuple[Iterable[tuple[int, bytes]], _Progress]]
) -> Iterator[ScanItem]:
    """One file's items; each part's status is complete once its hits have been read."""
    rank = rank_from_path(file)
    yield FileStart(file, rank)
    line_base = 1
    bytes_read = 0
    errors: list[str] = []
    for hits, status in parts:
        for index, raw in hits:
            yield from locate_line(raw, file, line_base + index, rank)
        line_base += status.newlines
        bytes_read += status.bytes_read
        if status.error:
            errors.append(status.error)
    yield FileDone(file, rank, line_base - 1, bytes_read, "; ".join(errors) or None)
