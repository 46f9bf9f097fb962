"""Live mode: a real writer process appends while the follower polls."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pretuner.logscan import LogFollower
from pretuner.logscan.events import OomEvent
from pretuner.logscan.pooldump import PoolDump
from tests.test_logscan_scanner import peak_mib

FIXTURES = Path(__file__).parent / "fixtures" / "logs"

# Writes the real OOM log in small uneven pieces (cutting lines in the middle), with pauses.
WRITER = r"""
import sys, time
data = open(sys.argv[1], "rb").read()
with open(sys.argv[2], "ab", buffering=0) as out:
    for start in range(0, len(data), 777):
        out.write(data[start:start + 777])
        time.sleep(0.01)
"""


def test_follow_real_writer(tmp_path: Path) -> None:
    target = tmp_path / "rank_2" / "server.log"
    follower = LogFollower(target)
    assert follower.poll() == []  # not there yet
    target.parent.mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(FIXTURES / "ms_cpu_oom.log"), str(target)],
        stdin=subprocess.DEVNULL,
    )
    events = []
    deadline = time.monotonic() + 60
    try:
        while writer.poll() is None and time.monotonic() < deadline:
            events.extend(follower.poll())
            time.sleep(0.005)
    finally:
        writer.kill()
        writer.wait()
    events.extend(follower.poll(final=True))
    expected = LogFollower(FIXTURES / "ms_cpu_oom.log").poll(final=True)
    assert [(e.line, e.event) for e in events] == [(e.line, e.event) for e in expected]
    assert all(e.rank == 2 for e in events)
    assert any(isinstance(e.event, OomEvent) for e in events)
    assert sum(isinstance(e.event, PoolDump) for e in events) == 2


def test_follow_reads_only_new_bytes_and_partial_lines(tmp_path: Path) -> None:
    target = tmp_path / "server.log"
    line = (FIXTURES / "ms_cpu_exit.log").read_bytes().splitlines(keepends=True)[7]
    target.write_bytes(b"noise\n" + line[:50])
    follower = LogFollower(target)
    assert follower.poll() == []
    with target.open("ab") as out:
        out.write(line[50:])
    events = follower.poll()
    assert [(e.line, peak_mib(e.event)) for e in events] == [(2, 512)]
    assert follower.offset == target.stat().st_size
    assert follower.poll() == []


def test_follow_truncated_file_starts_over(tmp_path: Path) -> None:
    target = tmp_path / "server.log"
    line = (FIXTURES / "ms_cpu_exit.log").read_bytes().splitlines(keepends=True)[7]
    target.write_bytes(b"a\n" * 100 + line)
    follower = LogFollower(target)
    assert [e.line for e in follower.poll()] == [101]
    target.write_bytes(line)
    assert [e.line for e in follower.poll()] == [1]
