"""Run order: the files that start real engines (vLLM on CPU, MindSpore, Ray) first.

The suite runs on two workers a file at a time (`--dist loadfile`), handing out files in
collection order. The real-engine files take minutes each and sorted last by name, so one
worker finished them alone at the end; started first, they run beside everything else.
"""

from __future__ import annotations

import pytest

REAL_ENGINES = ("vllm_cpu", "mindspore", "ray")


def _real_engine(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in REAL_ENGINES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy = {item.nodeid.split("::")[0] for item in items if _real_engine(item)}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in heavy)  # stable: files stay whole
