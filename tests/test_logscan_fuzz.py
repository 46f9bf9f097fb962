"""Property tests: no input crashes the parser, the scanner or the follower."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pretuner.logscan import LogFollower, scan_paths
from pretuner.logscan.lines import ANCHORS, parse_line, parse_origin, split_writers
from tests.test_logscan_lines import OOM_CASES, POOL_CASES, VLLM_CASES

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
REAL_LINES = [
    line
    for path in sorted(FIXTURES.rglob("*.log*"))
    if path.is_file() and not path.is_symlink()
    for line in path.read_bytes().splitlines()
] + [str(p.values[0]).encode() for p in POOL_CASES + OOM_CASES + VLLM_CASES]


@st.composite
def mutated_line(draw: st.DrawFn) -> bytes:
    """A real line with bytes replaced, inserted or cut, or pieces of two lines spliced."""
    line = bytearray(draw(st.sampled_from(REAL_LINES)))
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["set", "insert", "cut", "splice", "digits"]))
        at = draw(st.integers(0, max(0, len(line) - 1)))
        if op == "set" and line:
            line[at] = draw(st.integers(0, 255))
        elif op == "insert":
            line[at:at] = draw(st.binary(max_size=20))
        elif op == "cut":
            del line[at:]
        elif op == "splice":
            other = draw(st.sampled_from(REAL_LINES))
            line[at:] = other[draw(st.integers(0, len(other))) :]
        else:
            line[at:at] = draw(st.sampled_from([b"9" * 40, b"-1", b"1e308", b",,,", b"NaN"]))
    return bytes(line)


@given(st.binary(max_size=2000))
def test_random_bytes_never_crash(data: bytes) -> None:
    parse_line(data)
    parse_origin(data)
    parse_line(data.decode("latin-1"))


@pytest.mark.slow
@given(mutated_line())
@settings(max_examples=400)
def test_mutated_real_lines_never_crash(line: bytes) -> None:
    parse_line(line)
    parse_origin(line)


@pytest.mark.slow
@given(st.lists(st.one_of(mutated_line(), st.binary(max_size=300)), max_size=30), st.booleans())
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_scanner_and_follower_never_crash(lines: list[bytes], crlf: bool) -> None:
    data = (b"\r\n" if crlf else b"\n").join(lines)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "rank_0" / "x.log"
        target.parent.mkdir()
        target.write_bytes(data)
        result = scan_paths([Path(tmp)])
        result.to_json()
        followed = LogFollower(target).poll(final=True)
        # A line that holds two writers' lines (one cut short) is read as one piece each.
        pieces = [p for line in data.split(b"\n") for p in split_writers(line)]
        scanned = sum(1 for piece in pieces if any(a in piece for a in ANCHORS))
        assert len(followed) <= scanned
        assert result.events == len(followed)
