"""`run --help` and `plan --help` list their options in panels, so 40 options can be read."""

from __future__ import annotations

import re

import pytest

from tests.helpers import invoke

PANELS = ["Model and card", "Lengths and batching", "Engine and where it lives", "Proof",
          "Outputs", "Advanced"]


def sections(help_text: str) -> dict[str, list[str]]:
    """Each section title of a help page -> the long flags listed under it."""
    found: dict[str, list[str]] = {}
    title = None
    for line in help_text.splitlines():
        if re.fullmatch(r"[A-Z][\w ]*:", line):
            title = line[:-1]
            found[title] = []
        elif title is not None and line.startswith("  -"):
            found[title] += re.findall(r"(?<![\w-])--[a-z][\w-]*", line.split("  ", 2)[1])
    return found


@pytest.mark.parametrize(("command", "where"), [
    ("run", {"--model": "Model and card", "--card": "Model and card", "--tp": "Model and card",
             "--max-model-len": "Lengths and batching", "--max-num-seqs": "Lengths and batching",
             "--engine": "Engine and where it lives", "--serve-cmd": "Engine and where it lives",
             "--config": "Engine and where it lives", "--validate": "Proof", "--soak": "Proof",
             "--max-launches": "Proof", "--out": "Outputs", "--resume": "Outputs",
             "--dry-run": "Outputs", "--json": "Outputs", "--headroom-gb": "Advanced",
             "--stop-grace": "Advanced"}),
    ("plan", {"--model": "Model and card", "--cards-per-node": "Model and card",
              "--max-model-len": "Lengths and batching", "--engine": "Engine and where it lives",
              "--json": "Outputs", "--kv-gib": "Outputs", "--headroom-gb": "Advanced"}),
])  # fmt: skip
def test_help_groups_every_option_into_its_panel(command: str, where: dict[str, str]) -> None:
    proc = invoke(command, "--help")
    assert proc.returncode == 0, proc.stderr
    found = sections(proc.stdout)
    # The panels in this order, then typer's own section holding --help alone: an option added
    # without a panel would land there.
    assert [title for title in found if title != "Usage"] == [
        *[p for p in PANELS if p != "Proof" or command == "run"], "Options"]
    assert found["Options"] == ["--help"]
    for flag, panel in where.items():
        assert flag in found[panel], f"{command} --help: {flag} is not under {panel}"
