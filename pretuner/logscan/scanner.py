"""Find the memory lines in log files at grep speed, with bounded memory.

Plain files are read through 16 MiB `mmap` windows that end on a line boundary, so memory
stays flat whatever the file size. In each window, every anchor of `lines.ANCHORS` is searched
in one vectorised pass: an anchor of 15 bytes or more always covers one 8-byte word aligned to
the window start, so hashing each aligned word into a table of the anchors' words finds every
occurrence at once (one multiply, one shift, one table lookup per 8 bytes), instead of one
`find` pass per anchor. Only the few lines around a real hit are decoded and parsed. Large
files are cut at line boundaries into segments that worker processes scan in parallel.
"""

from __future__ import annotations

import bisect
import gzip
import logging
import mmap
import multiprocessing
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pretuner.logscan.lines import ANCHORS, Located, locate_line

log = logging.getLogger(__name__)

WINDOW_BYTES = 16 * 2**20  # bytes mapped at a time: bounds the resident set
SUB_WORDS = 2**17  # 1 MiB of 8-byte words per vectorised step: temporaries stay in cache
PARALLEL_MIN_BYTES = 64 * 2**20  # smaller inputs are scanned in this process
MAX_HIT_LINE_BYTES = 32 * 2**10  # a longer hit line is cut around the hit
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)
_HASH_SHIFT = np.uint64(48)
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_RANK_FILE = re.compile(r"(?:^|[._-])rank[_-]?(\d+)(?:[._-]|$)")


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A file, or part of one, that could not be read, and why."""

    file: str
    reason: str


@dataclass(frozen=True, slots=True)
class FileScan:
    """Everything found in one file."""

    file: str
    rank: int | None  # from a rank_<N> folder or file name
    events: tuple[Located, ...]
    lines: int
    bytes_read: int
    error: str | None


class _AnchorTable:
    """The hashed 8-byte words of every anchor, for the one-pass search."""

    def __init__(self, anchors: Sequence[bytes]) -> None:
        self.by_word: dict[int, list[tuple[bytes, int]]] = {}
        for anchor in anchors:
            if len(anchor) < 15:
                raise ValueError(f"anchor {anchor!r} is shorter than 15 bytes")
            for shift in range(8):
                # An occurrence starting 8-shift bytes before an aligned word has aligned
                # words at offsets shift, shift+8, ... of the anchor: keep the rarest-looking.
                offsets = range(shift, len(anchor) - 7, 8)
                offset = max(offsets, key=lambda o: _rarity(anchor[o : o + 8]))
                word = int.from_bytes(anchor[offset : offset + 8], "little")
                self.by_word.setdefault(word, []).append((anchor, offset))
        self.words = np.array(sorted(self.by_word), dtype=np.uint64)
        self.table = np.zeros(1 << 16, dtype=np.bool_)
        self.table[((self.words * _HASH_MULT) >> _HASH_SHIFT).astype(np.int64)] = True


# Words frequent in MindSpore and vLLM INFO noise: a hash word holding one is a poor filter.
_COMMON = (
    b"memory ",
    b"memory(",
    b"mem ",
    b"Availab",
    b"alloc",
    b"size",
    b"total",
    b"model",
    b"cache",
)


def _rarity(word: bytes) -> int:
    """Rough rarity of a word in log noise: capitals, digits and symbols beat common words."""
    score = sum(0 if 97 <= c <= 122 else 2 if c == 32 else 3 for c in word)
    return score - 6 * sum(common in word for common in _COMMON)


_TABLE = _AnchorTable(ANCHORS)


def find_anchor_lines(
    buf: bytes | bytearray | mmap.mmap, start: int, end: int
) -> tuple[list[tuple[int, int, int, int]], int]:
    """Lines of buf[start:end] holding an anchor, and the number of newlines in that range.

    Each hit is (line_start, line_end, hit_offset, newlines_before_line) with newlines counted
    from `start`. buf[start:end] should end on a line boundary.
    """
    hits: dict[int, tuple[int, int, int, int]] = {}
    steps: list[tuple[int, int]] = []  # (step start, newlines before it)
    newlines = 0
    n_words = (end - start) // 8
    tmp = np.empty(min(SUB_WORDS, max(n_words, 1)), dtype=np.uint64)
    pos = start
    while pos < end:
        count = min(SUB_WORDS, (end - pos) // 8)
        step_end = pos + count * 8 if count == SUB_WORDS else end
        if count:
            _hits_in_words(buf, pos, count, tmp[:count], start, end, hits)
        steps.append((pos, newlines))
        newlines += _count_newlines(buf, pos, step_end)
        pos = step_end
    located = []
    for line_start, line_end, hit, _ in hits.values():
        k = bisect.bisect_right(steps, (line_start, newlines + 1)) - 1
        step_start, before = steps[k]
        located.append(
            (line_start, line_end, hit, before + _count_newlines(buf, step_start, line_start))
        )
    return sorted(located), newlines


def _count_newlines(buf: bytes | bytearray | mmap.mmap, a: int, b: int) -> int:
    if b <= a:
        return 0
    raw: npt.NDArray[np.uint8] = np.frombuffer(buf, dtype=np.uint8, count=b - a, offset=a)
    return int(np.count_nonzero(raw == 10))


def _hits_in_words(
    buf: bytes | bytearray | mmap.mmap,
    pos: int,
    count: int,
    tmp: npt.NDArray[np.uint64],
    start: int,
    end: int,
    hits: dict[int, tuple[int, int, int, int]],
) -> None:
    words: npt.NDArray[np.uint64] = np.frombuffer(buf, dtype=np.uint64, count=count, offset=pos)
    np.multiply(words, _HASH_MULT, out=tmp)
    np.right_shift(tmp, _HASH_SHIFT, out=tmp)
    candidates = np.flatnonzero(_TABLE.table.take(tmp.view(np.int64)))
    if candidates.size:
        values = words[candidates]
        slot = np.searchsorted(_TABLE.words, values)
        np.minimum(slot, len(_TABLE.words) - 1, out=slot)
        found = candidates[_TABLE.words[slot] == values]
        for index in found.tolist():
            word_at = pos + 8 * index
            for anchor, offset in _TABLE.by_word[int(words[index])]:
                at = word_at - offset
                if at >= start and at + len(anchor) <= end and buf[at : at + len(anchor)] == anchor:
                    line_start = buf.rfind(b"\n", start, at) + 1 or start
                    line_start = max(line_start, start)
                    if line_start not in hits:
                        line_end = buf.find(b"\n", at, end)
                        hits[line_start] = (line_start, end if line_end < 0 else line_end, at, -1)
    del words


def _hit_bytes(
    buf: bytes | bytearray | mmap.mmap, line_start: int, line_end: int, hit: int
) -> bytes:
    if line_end - line_start <= MAX_HIT_LINE_BYTES:
        return bytes(buf[line_start:line_end])
    # Keep the head (the writer's prefix) and a window around the hit.
    head = bytes(buf[line_start : line_start + 512])
    lo = max(line_start + 512, hit - MAX_HIT_LINE_BYTES // 4)
    return head + b" ... " + bytes(buf[lo : min(line_end, hit + MAX_HIT_LINE_BYTES // 2)])


def rank_from_path(path: str) -> int | None:
    """The rank a file belongs to: a `rank_<N>` folder (GLOG_log_dir with RANK_ID) or name."""
    parts = Path(path).parts
    for part in reversed(parts[:-1]):
        found = _RANK_DIR.match(part)
        if found:
            return int(found.group(1))
    found = _RANK_FILE.search(parts[-1]) if parts else None
    return int(found.group(1)) if found else None


@dataclass(frozen=True, slots=True)
class _Segment:
    file: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class _SegmentHits:
    lines: tuple[tuple[int, bytes], ...]  # (line index from segment start, 0-based; bytes)
    newlines: int
    bytes_read: int
    error: str | None


def _scan_segment(segment: _Segment) -> _SegmentHits:
    """Scan [start, end) of a plain file; both ends are line boundaries (or the file's ends)."""
    found: list[tuple[int, bytes]] = []
    newlines = 0
    pos = segment.start
    try:
        with open(segment.file, "rb") as handle:
            fd = handle.fileno()
            while pos < segment.end:
                map_at = pos - pos % mmap.ALLOCATIONGRANULARITY
                length = min(WINDOW_BYTES, segment.end - map_at)
                window = mmap.mmap(fd, length, offset=map_at, access=mmap.ACCESS_READ)
                try:
                    first = pos - map_at
                    if map_at + length >= segment.end:
                        last = length
                    else:
                        last = window.rfind(b"\n", first, length) + 1
                        if last <= first:  # a line longer than the window: cut it
                            last = length
                    hits, count = find_anchor_lines(window, first, last)
                    for line_start, line_end, hit, before in hits:
                        raw = _hit_bytes(window, line_start, line_end, hit)
                        found.append((newlines + before, raw))
                    newlines += count
                finally:
                    window.close()
                pos = map_at + last
    except (OSError, ValueError) as err:
        return _SegmentHits(tuple(found), newlines, pos - segment.start, f"read error: {err}")
    return _SegmentHits(tuple(found), newlines, pos - segment.start, None)


def _scan_stream(path: str) -> _SegmentHits:
    """Scan a compressed file through a bounded buffer; keeps what was read before an error."""
    piece = 256 * 2**10  # small reads: a truncated stream loses at most one piece
    batch = 4 * 2**20
    buf = bytearray()
    found: list[tuple[int, bytes]] = []
    newlines = 0
    total = 0
    error: str | None = None

    def flush(last: int) -> None:
        nonlocal newlines
        hits, count = find_anchor_lines(buf, 0, last)
        for line_start, line_end, hit, before in hits:
            found.append((newlines + before, _hit_bytes(buf, line_start, line_end, hit)))
        newlines += count
        del buf[:last]

    try:
        with gzip.open(path, "rb") as stream:
            while True:
                data = stream.read(piece)
                total += len(data)
                buf += data
                if not data:
                    break
                if len(buf) >= batch:
                    last = buf.rfind(b"\n") + 1
                    # A line longer than four batches is cut rather than held.
                    flush(last if last else len(buf) if len(buf) >= 4 * batch else 0)
    except (OSError, EOFError, zlib.error) as err:
        error = f"decompression stopped after {total:,} bytes: {err}"
    if buf:
        flush(len(buf))
    return _SegmentHits(tuple(found), newlines, total, error)


def _is_gzip(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def _split_points(path: str, size: int, parts: int) -> list[int]:
    """Cut a file into `parts` ranges whose ends are line starts."""
    points = [0]
    with open(path, "rb") as handle:
        for k in range(1, parts):
            target = size * k // parts
            handle.seek(target - 1)
            at = target - 1
            cut = size
            while at < size and at - target < WINDOW_BYTES:
                block = handle.read(65536)
                if not block:
                    break
                nl = block.find(b"\n")
                if nl >= 0:
                    cut = at + nl + 1
                    break
                at += len(block)
            if cut > points[-1]:
                points.append(min(cut, size))
    points.append(size)
    return sorted(set(points))


def scan_files(files: Sequence[str], *, workers: int | None = None) -> list[FileScan]:
    """Scan each file (plain or gzip), large ones in parallel segments, in the given order."""
    jobs: list[tuple[str, list[_Segment] | None]] = []
    total = 0
    for file in files:
        try:
            size = os.path.getsize(file)
        except OSError:
            size = 0
        total += size
        jobs.append((file, None if _is_gzip(file) else [_Segment(file, 0, size)]))
    cpus = workers if workers is not None else (os.cpu_count() or 1)
    parallel = cpus > 1 and total >= PARALLEL_MIN_BYTES
    if parallel:
        piece = max(PARALLEL_MIN_BYTES // 2, total // (cpus * 2))
        for i, (file, segments) in enumerate(jobs):
            if segments and segments[0].end > piece:
                size = segments[0].end
                points = _split_points(file, size, min(cpus * 2, max(2, size // piece)))
                jobs[i] = (
                    file,
                    [_Segment(file, a, b) for a, b in zip(points, points[1:], strict=False)],
                )
    results: dict[tuple[str, int], _SegmentHits] = {}
    if parallel:
        context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ProcessPoolExecutor(max_workers=cpus, mp_context=context) as pool:
            futures = {}
            for file, segments in jobs:
                if segments is None:
                    futures[(file, -1)] = pool.submit(_scan_stream, file)
                else:
                    for seg in segments:
                        futures[(file, seg.start)] = pool.submit(_scan_segment, seg)
            results = {key: future.result() for key, future in futures.items()}
    else:
        for file, segments in jobs:
            if segments is None:
                results[(file, -1)] = _scan_stream(file)
            else:
                for seg in segments:
                    results[(file, seg.start)] = _scan_segment(seg)
    return [_assemble(file, segments, results) for file, segments in jobs]


def _assemble(
    file: str, segments: list[_Segment] | None, results: dict[tuple[str, int], _SegmentHits]
) -> FileScan:
    rank = rank_from_path(file)
    parts = (
        [results[(file, -1)]] if segments is None else [results[(file, s.start)] for s in segments]
    )
    events: list[Located] = []
    line_base = 1
    bytes_read = 0
    errors: list[str] = []
    for part in parts:
        for index, raw in part.lines:
            events += locate_line(raw, file, line_base + index, rank)
        line_base += part.newlines
        bytes_read += part.bytes_read
        if part.error:
            errors.append(part.error)
    return FileScan(
        file=file,
        rank=rank,
        events=tuple(events),
        lines=line_base - 1,
        bytes_read=bytes_read,
        error="; ".join(errors) or None,
    )


def iter_log_files(paths: Sequence[Path]) -> Iterator[tuple[str, str | None]]:
    """Every regular file under the given paths, once each: (path, None) or (path, problem).

    Directories are walked recursively without following links; a symlink (like MindSpore's
    `mindspore.INFO` pointing to the newest log) is skipped when its target is already listed.
    """
    seen: set[tuple[int, int]] = set()
    pending: list[str] = []
    links: list[str] = []
    for path in paths:
        text = str(path)
        if os.path.isdir(text):
            for root, dirs, names in os.walk(text):
                dirs.sort()
                for name in sorted(names):
                    full = os.path.join(root, name)
                    (links if os.path.islink(full) else pending).append(full)
        else:
            pending.append(text)
    for full in pending + links:
        try:
            info = os.stat(full)
        except OSError as err:
            yield full, f"cannot stat: {err.strerror or err}"
            continue
        key = (info.st_dev, info.st_ino)
        if key in seen or not os.path.isfile(full):
            continue
        seen.add(key)
        yield full, None
