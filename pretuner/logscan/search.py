"""The vectorised anchor search: which lines of a buffer hold one of the parser's anchors.

Every anchor is at least 15 bytes long, so each occurrence covers an 8-byte-aligned word;
numpy hashes every aligned word of the buffer and only the words whose hash matches an
anchor's are compared for real.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pretuner.logscan.lines import ANCHORS

SUB_WORDS = 2**17  # 1 MiB of 8-byte words per vectorised step: temporaries stay in cache
MAX_HIT_LINE_BYTES = 32 * 2**10  # a longer hit line is cut around the hit
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)
_HASH_SHIFT = np.uint64(48)


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
    newlines = 0
    n_words = (end - start) // 8
    tmp = np.empty(min(SUB_WORDS, max(n_words, 1)), dtype=np.uint64)
    pos = start
    while pos < end:
        count = min(SUB_WORDS, (end - pos) // 8)
        step_end = pos + count * 8 if count == SUB_WORDS else end
        if count:
            _hits_in_words(buf, pos, count, tmp[:count], start, end, hits)
        newlines += _count_newlines(buf, pos, step_end)
        pos = step_end
    if not hits:
        return [], newlines
    # One pass over the newlines, then a binary search per hit: a range dense with hits (a
    # pool dump of thousands of lines) costs no more than a sparse one.
    raw: npt.NDArray[np.uint8] = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start)
    breaks = np.flatnonzero(raw == 10)
    del raw
    starts = sorted(hits)
    before = np.searchsorted(breaks, np.array(starts, dtype=np.int64) - start).tolist()
    return [(*hits[at][:3], n) for at, n in zip(starts, before, strict=True)], newlines


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


def hit_bytes(
    buf: bytes | bytearray | mmap.mmap, line_start: int, line_end: int, hit: int
) -> bytes:
    """The bytes of one hit line; a line longer than MAX_HIT_LINE_BYTES is cut around its hit."""
    if line_end - line_start <= MAX_HIT_LINE_BYTES:
        return bytes(buf[line_start:line_end])
    # Keep the head (the writer's prefix) and a window around the hit.
    head = bytes(buf[line_start : line_start + 512])
    lo = max(line_start + 512, hit - MAX_HIT_LINE_BYTES // 4)
    return head + b" ... " + bytes(buf[lo : min(line_end, hit + MAX_HIT_LINE_BYTES // 2)])


__all__ = ["MAX_HIT_LINE_BYTES", "find_anchor_lines", "hit_bytes"]
