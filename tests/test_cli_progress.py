"""`pretuner run`'s progress: phase lines, and a status that keeps moving between them."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

from pretuner.cli.progress import Progress
from pretuner.launch.sampler import requests_status


def _until(check: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)


def test_plain_output_says_something_during_a_long_silent_phase() -> None:
    out = io.StringIO()
    progress = Progress(out, 8, live=False, heartbeat_s=0.3)
    try:
        progress("launch", "validate util 0.9")
        progress("load", "8 concurrent requests of 16,384 tokens")
        requests_status(progress)(3, 8)
        progress("memory", "61,234 MiB used now, peak 62,001 MiB this launch (emulated)")
        _until(lambda: "in flight" in out.getvalue())
    finally:
        progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("#1 launch  validate util 0.9")
    assert "#1 load    8 concurrent requests" in lines[1]
    beat = next(line for line in lines if "in flight" in line)
    assert "launch 1 of at most 8: load for" in beat
    assert "| requests 3/8 done, 5 in flight" in beat
    assert "| memory 61,234 MiB used now, peak 62,001 MiB" in beat
    # A status update is not a phase: no line of its own, and the phase stays "load".
    assert not any(line.split("]", 1)[1].split()[1:2] == ["requests"] for line in lines)


def test_a_new_launch_forgets_the_last_launchs_status() -> None:
    out = io.StringIO()
    progress = Progress(out, 3, live=False, heartbeat_s=60)
    try:
        progress("launch", "prerun")
        requests_status(progress)(1, 1)
        progress("launch", "validate")
        assert "requests" not in progress.status_line()
        assert "launch 2 of at most 3" in progress.status_line()
    finally:
        progress.close()


def test_launch_numbers_continue_after_the_launches_a_resume_replays() -> None:
    # Seen: after --resume replayed launches 1 and 2, the next launch was shown as #1 while its
    # folder was launch-3; the number shown is the launch folder's.
    out = io.StringIO()
    progress = Progress(out, 8, live=False, heartbeat_s=60)
    try:
        progress("replay", "launch 1 finished in the earlier session: fits")
        progress("replay", "launch 2 finished in the earlier session: fits")
        progress("launch", "validate")
        assert "launch 3 of at most 8" in progress.status_line()
    finally:
        progress.close()
    assert [line.split("]", 1)[1].split()[0] for line in out.getvalue().splitlines()] == [
        "#1", "#2", "#3"]


def test_on_a_terminal_the_status_is_a_live_line_under_the_phase_lines() -> None:
    out = io.StringIO()
    progress = Progress(out, 8, live=True, heartbeat_s=0.1)
    try:
        progress("launch", "prerun util 0.9")
        requests_status(progress)(2, 4)
        _until(lambda: "2/4 done" in out.getvalue())
    finally:
        progress.close()
    text = out.getvalue()
    assert "#1 launch  prerun util 0.9" in text
    assert "requests 2/4 done" in text  # cut to the terminal width where it is narrow
    assert "\x1b[" in text  # drawn as a terminal line, redrawn in place
