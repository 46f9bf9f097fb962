"""No import cycle in `pretuner/`: between packages, or between modules (function-level
imports count: one that exists only to break a cycle still is one)."""

from __future__ import annotations

from tests.helpers import load_script


def test_no_import_cycle() -> None:
    # Module cycles count their function-level imports: one that exists only to break a cycle
    # still is one (scripts/import_cycles.py prints them).
    found = load_script("import_cycles")
    cycles, graph = found.cycles, found.graph
    assert graph(False)["pretuner.tune.entry"]  # the walk read the imports
    assert cycles(graph(True)) == []
    assert cycles(graph(False)) == []


def test_the_cycle_finder_finds_one() -> None:
    cycles = load_script("import_cycles").cycles
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
