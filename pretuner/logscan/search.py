"""The vectorised anchor search: which lines of a buffer hold one of the parser's anchors.

Every anchor is at least 15 bytes long, so each occurrence covers an 8-byte-aligned word;
numpy hashes every aligned word of the buffer, keeps the words whose hash matches an anchor
word's, then those equal to one whose neighbouring words agree with the anchor, and only
these are compared for real. The same pass counts the newlines.
"""

from __future__ import annotations

import mmap
import threading
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
        # The aligned words on either side of a hit word, as far as its anchors tell: a
        # vectorised second check, so that a word that is common in the noise (" memory ",
        # "dynamic ") costs no comparison in Python.
        before = [_neighbour(self.by_word[w], -8) for w in self.words.tolist()]
        after = [_neighbour(self.by_word[w], 8) for w in self.words.tolist()]
        self.before_mask, self.before_value = np.array(before, dtype=np.uint64).T
        self.after_mask, self.after_value = np.array(after, dtype=np.uint64).T


def _neighbour(entries: Sequence[tuple[bytes, int]], delta: int) -> tuple[int, int]:
    """(mask, value) of the word `delta` bytes from a hit word: the bytes all its anchors share."""
    mask = value = 0
    for byte in range(8):
        seen = {
            anchor[at] if 0 <= (at := offset + delta + byte) < len(anchor) else None
            for anchor, offset in entries
        }
        if len(seen) == 1 and (known := seen.pop()) is not None:
            mask |= 0xFF << (8 * byte)
            value |= known << (8 * byte)
    return mask, value


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
    b"dynamic",  # "Load dynamic library" and the like: 100,000s of INFO lines a GiB
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
    scratch = _scratch()
    pos = start
    while pos < end:
        # Words from an 8-byte boundary on (numpy's fast loops want aligned data): an anchor
        # of 15 bytes or more still covers a whole word, wherever it starts.
        words_at = pos + (-pos) % 8
        count = min(SUB_WORDS, max(0, end - words_at) // 8)
        step_end = words_at + count * 8 if count == SUB_WORDS else end
        raw: npt.NDArray[np.uint8] = np.frombuffer(
            buf, dtype=np.uint8, count=step_end - pos, offset=pos
        )
        newline = scratch.newline[: step_end - pos]
        np.equal(raw, 10, out=newline)
        del raw
        fresh: dict[int, tuple[int, int]] = {}  # this step's new lines: start -> (end, anchor)
        for at in _anchors_in_words(buf, words_at, count, scratch, start, end) if count else ():
            line_start = max(buf.rfind(b"\n", start, at) + 1, start)
            if line_start not in hits and line_start not in fresh:
                line_end = buf.find(b"\n", at, end)
                fresh[line_start] = (end if line_end < 0 else line_end, at)
        if fresh:
            # A line's number is that of its anchor: neither the anchor nor the text before it
            # on its line holds a newline. One pass over this step's newlines, then a binary
            # search per hit: a step dense with hits (a pool dump) costs no more than a sparse one.
            # (An anchor that began in the step before is at a negative offset: 0 newlines.)
            ats = np.array([at for _, at in fresh.values()], dtype=np.int64) - pos
            before = np.searchsorted(np.flatnonzero(newline), ats).tolist()
            for (line_start, (line_end, at)), n in zip(fresh.items(), before, strict=True):
                hits[line_start] = (line_start, line_end, at, newlines + n)
        newlines += int(np.count_nonzero(newline))
        pos = step_end
    return [hits[k] for k in sorted(hits)], newlines


class _Scratch:
    """A thread's temporaries, allocated once: each step writes into them in place."""

    __slots__ = ("flags", "hashes", "newline", "words")

    def __init__(self, words: int) -> None:
        self.words = words
        self.hashes: npt.NDArray[np.uint64] = np.empty(words, dtype=np.uint64)
        self.flags: npt.NDArray[np.bool_] = np.empty(words, dtype=np.bool_)
        # A step's bytes: its words, and up to 7 before the first (see `find_anchor_lines`).
        self.newline: npt.NDArray[np.bool_] = np.empty(8 * words + 8, dtype=np.bool_)


_LOCAL = threading.local()


def _scratch() -> _Scratch:
    # Fresh arrays per call would cost more than the search itself: the pages of a large
    # allocation are faulted in anew each time.
    scratch: _Scratch | None = getattr(_LOCAL, "scratch", None)
    if scratch is None or scratch.words < SUB_WORDS:
        scratch = _LOCAL.scratch = _Scratch(SUB_WORDS)
    return scratch


def _anchors_in_words(
    buf: bytes | bytearray | mmap.mmap,
    pos: int,
    count: int,
    scratch: _Scratch,
    start: int,
    end: int,
) -> list[int]:
    """Where the anchors are that cover an aligned word of the `count` words at `pos`."""
    words: npt.NDArray[np.uint64] = np.frombuffer(buf, dtype=np.uint64, count=count, offset=pos)
    hashes = scratch.hashes[:count]
    flags = scratch.flags[:count]
    np.multiply(words, _HASH_MULT, out=hashes)
    np.right_shift(hashes, _HASH_SHIFT, out=hashes)
    # Every hash is below the table size: "wrap" never wraps, it only skips the error path.
    _TABLE.table.take(hashes.view(np.int64), out=flags, mode="wrap")
    candidates = np.flatnonzero(flags)
    if not candidates.size:
        return []
    values = words[candidates]
    slot = np.searchsorted(_TABLE.words, values)
    np.minimum(slot, len(_TABLE.words) - 1, out=slot)
    match = _TABLE.words[slot] == values
    found = candidates[match]
    if found.size:
        slot = slot[match]
        # A word at either end of the step has its neighbour in the next or previous step:
        # it is let through to the full comparison.
        after = words[np.minimum(found + 1, count - 1)]
        before = words[np.maximum(found - 1, 0)]
        ok = (after & _TABLE.after_mask[slot]) == _TABLE.after_value[slot]
        ok &= (before & _TABLE.before_mask[slot]) == _TABLE.before_value[slot]
        ok |= (found == 0) | (found == count - 1)
        found = found[ok]
    anchors: list[int] = []
    for index in found.tolist():
        word_at = pos + 8 * index
        for anchor, offset in _TABLE.by_word[int(words[index])]:
            at = word_at - offset
            if at >= start and at + len(anchor) <= end and buf[at : at + len(anchor)] == anchor:
                anchors.append(at)
    del words
    return anchors


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
