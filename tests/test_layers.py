"""The package's layers, read from its source: production never imports the emulator
(ARCHITECTURE.md rule 3); it finds it as a plugin (`pretuner.emulation`)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from tests.test_sim_independent import PACKAGE, imported, imports_in, module_name

# The emulator's own package, and the CLI that starts its servers and tools by hand.
EMULATOR_SIDE = ("pretuner.sim", "pretuner.cli.sim")


def on_emulator_side(module: str) -> bool:
    return any(module == m or module.startswith(f"{m}.") for m in EMULATOR_SIDE)


PRODUCTION = sorted(p for p in PACKAGE.rglob("*.py") if not on_emulator_side(module_name(p)))


def sim_imports(path: Path) -> set[str]:
    return {m for m in imported(path) if m == "pretuner.sim" or m.startswith("pretuner.sim.")}


@pytest.mark.parametrize(("code", "found"), [
    ("from pretuner.sim.reader import EmulatedReader", True),
    ("def f():\n    import pretuner.sim.v1.offload", True),
    ("from pretuner import sim", True),
    ("runpy.run_module('pretuner.sim.serve')", True),
    ("from pretuner.simulate import x", False),  # another module whose name starts alike
    ("from pretuner.emulation import emulator", False),
])
def test_the_walk_sees_an_import_of_the_emulator(code: str, found: bool) -> None:
    names = imports_in(code, "pretuner.devices")
    assert any(m == "pretuner.sim" or m.startswith("pretuner.sim.") for m in names) is found


def test_no_production_module_imports_the_emulator() -> None:
    walked = {module_name(p) for p in PRODUCTION}
    assert {"pretuner.devices.selection", "pretuner.tune.entry", "pretuner.cli.run"} <= walked
    assert not {module_name(p): sorted(sim_imports(p)) for p in PRODUCTION if sim_imports(p)}


def test_production_finds_the_emulator_through_its_entry_point() -> None:
    from pretuner.emulation import GROUP, emulator

    (entry,) = importlib.metadata.entry_points(group=GROUP)
    assert entry.value == "pretuner.sim.plugin:EMULATOR"
    assert emulator().server_command("v1")[1:] == ["-m", "pretuner.sim", "vllm", "serve"]



def test_every_engine_is_an_engine_to_the_pipeline() -> None:
    # What mypy checks statically (these assignments), and what the parity table relies on:
    # the r0.1 engine and the V1 engines answer the same protocol.
    from pretuner.engines.base import Engine, Family
    from pretuner.engines.mindspore_r01 import NAMES, R01Engine
    from pretuner.engines.vllm_v1 import ROWS, V1Engine

    engines: list[Engine] = [R01Engine(n, n == "sim", None, "test") for n in NAMES]
    engines += [V1Engine(row, simulated=True) for row in ROWS.values()]
    assert {e.family for e in engines} == {Family.R01, Family.V1}
    assert len({e.name for e in engines}) == len(engines)
