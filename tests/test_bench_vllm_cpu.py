"""scripts/bench_vllm_cpu.py's pure parts: its options, the bisection on a scripted server,
the launch command it derives and its table. Nothing is launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pretuner.units import MIB
from tests.helpers import load_script

bench = load_script("bench_vllm_cpu")


def test_defaults_and_bad_options() -> None:
    args = bench.parse_args([])
    assert (args.card, args.max_bisect, args.resolution_mib, args.span_mib) == (6, 6, 8, 512)
    assert (args.tuned, args.recheck_found) == (None, False)
    args = bench.parse_args(["--max-bisect", "3", "--tuned", "/x", "--recheck-found"])
    assert (args.max_bisect, args.tuned, args.recheck_found) == (3, Path("/x"), True)
    with pytest.raises(SystemExit):
        bench.parse_args(["--resolution-mib", "0"])


def _scripted(edge_mib: float) -> tuple[list[int], object]:
    tried: list[int] = []

    def holds(kv: int) -> object:
        tried.append(kv)
        return bench.Probe(kv, kv <= edge_mib * MIB, "scripted", 1.0)

    return tried, holds


def test_the_bisection_finds_the_known_edge_in_six_launches() -> None:
    """The manual runs' edge: 5,176 MiB holds, 5,184 MiB dies; pretuner found 5,150 MiB."""
    tried, holds = _scripted(5180)
    clock = iter([0.0, 42.0])
    b = bench.bisect(holds, 5150 * MIB, 5662 * MIB, 8 * MIB, 6, clock=lambda: next(clock))
    assert len(b.probes) == len(tried) == 6
    assert all(kv % MIB == 0 for kv in tried)
    assert b.lo_bytes <= 5180 * MIB < b.hi_bytes
    assert b.hi_died
    assert b.resolution_bytes <= 8 * MIB
    assert b.wall_s == 42.0


def test_the_bisection_stops_at_its_launch_bound_and_when_nothing_dies() -> None:
    tried, holds = _scripted(10**6)
    b = bench.bisect(holds, 0, 1024 * MIB, 8 * MIB, 3)
    assert (len(tried), b.hi_died, b.hi_bytes) == (3, False, 1024 * MIB)
    assert bench.bisect(holds, 0, 1024 * MIB, 8 * MIB, 0).probes == ()
    assert bench.next_probe(0, 8 * MIB, 8 * MIB) is None
    assert bench.next_probe(0, 9 * MIB, 8 * MIB) == 4 * MIB


def test_with_kv_replaces_only_the_kv_and_the_port() -> None:
    argv = ["py", "-m", "vllm", "--port", "1", "--kv-cache-memory-bytes", "5", "--x", "y"]
    assert bench.with_kv(argv, 7, 9) == ["py", "-m", "vllm", "--port", "9",
                                         "--kv-cache-memory-bytes", "7", "--x", "y"]
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        bench.with_kv(["py", "--port", "1"], 7, 9)


def _summary(found_mib: int, max_mib: int, launches: int) -> Any:  # the script's Summary
    return bench.Summary(found_mib=found_mib, max_mib=max_mib, edge_mib=max_mib + 8,
                         edge_died=True, ratio=found_mib / max_mib, launches=launches,
                         tune_wall_s=300.0, bisect_launches=6, bisect_wall_s=420.0,
                         undetected_oom=int(found_mib > max_mib))


def test_the_table_says_whether_each_target_holds() -> None:
    good = _summary(5150, 5176, 4)
    text = "\n".join(bench.table(good))
    assert good.all_ok
    for shown in ("5,150.0 MiB", "5,176.0 MiB", "0.9950"):
        assert shown in text
    assert "NO" not in text
    bad = _summary(5200, 5176, 5)
    assert (bad.all_ok, bad.oom_ok, bad.launches_ok, bad.ratio_ok) == (False, False, False, True)
    assert "\n".join(bench.table(bad)).count("NO") == 2
