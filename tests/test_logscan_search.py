"""The vectorised anchor search finds what a plain `in` test finds, with the same line numbers."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pretuner.logscan import search
from pretuner.logscan.lines import ANCHORS

# Noise that shares words with the anchors, so that the hash and neighbour checks are tried.
NOISE = [
    b"[INFO] PRE_ACT(4000,7f44c3888b80,python):2025-05-16-23:00:00.000.000 "
    b"[mem_dynamic_allocator.cc:161] Initialize] Skip initialization of memory pool since",
    b"Load dynamic library: libmindspore_ascend.so.2 failed. The dynamic memory",
    b"Device MOC Si",
    b"actual peak use",
    b"GPU KV cache size 12",
    b"",
    b"x" * 40,
]


def reference(data: bytes, start: int, end: int) -> tuple[list[tuple[int, int, int]], int]:
    """(line start, line end, newlines before) of each line of data[start:end] holding an anchor."""
    found = []
    at = start
    for number, line in enumerate(data[start:end].split(b"\n")):
        if any(anchor in line for anchor in ANCHORS):
            found.append((at, at + len(line), number))
        at += len(line) + 1
    return found, data.count(b"\n", start, end)


@st.composite
def log(draw: st.DrawFn) -> tuple[bytes, int, int]:
    """Lines of noise and anchors, anchors anywhere in a line; a range of it to search."""
    lines = []
    for _ in range(draw(st.integers(0, 40))):
        parts = draw(st.lists(st.sampled_from(NOISE + list(ANCHORS)), max_size=4))
        lines.append(b" ".join(parts) + draw(st.binary(max_size=9)).replace(b"\n", b""))
    data = b"\n".join(lines) + draw(st.sampled_from([b"", b"\n"]))
    # Starts at any byte of a line start's neighbourhood: the words are then unaligned.
    starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10]
    start = min(draw(st.sampled_from(starts)), len(data))
    return data, start, len(data)


@pytest.mark.parametrize("sub_words", [1, 2, 3, 5, 64, 2**17])
@given(case=log())
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_search_matches_a_plain_scan(
    case: tuple[bytes, int, int], sub_words: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiny steps put anchors across step boundaries, where the neighbour check cannot look.
    data, start, end = case
    with monkeypatch.context() as patch:
        patch.setattr(search, "SUB_WORDS", sub_words)
        hits, newlines = search.find_anchor_lines(data, start, end)
    expected, expected_newlines = reference(data, start, end)
    assert newlines == expected_newlines
    assert [(a, b, n) for a, b, _, n in hits] == expected
    for line_start, line_end, hit, _ in hits:
        assert line_start <= hit < line_end
        assert any(data.startswith(anchor, hit) for anchor in ANCHORS)


def test_search_over_an_mmap_at_an_odd_offset(tmp_path: Path) -> None:
    """A window of a real file, searched from a line start that is not on a word boundary."""
    line = b"[INFO] PRE_ACT(7,7,python):x] The dynamic memory pool total allocated mem:1M"
    noise = b"Load dynamic library: libge_runner.so failed, memory pool since it"
    data = b"a\n" + (noise + b"\n") * 5000 + line + b"\n" + (noise + b"\n") * 77 + line + b"\n"
    (tmp_path / "a.log").write_bytes(data)
    with (tmp_path / "a.log").open("rb") as handle:
        window = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            hits, newlines = search.find_anchor_lines(window, 2, len(data))
        finally:
            window.close()
    assert [n for *_, n in hits] == [5000, 5078]
    assert newlines == 5079
