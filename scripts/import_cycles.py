"""Import cycles in `pretuner/`: between packages, and between modules (function-level
imports included, since one that exists only to break a cycle still is one).

    python scripts/import_cycles.py            # prints every cycle; exit 1 when there is one
    python scripts/import_cycles.py --packages # package cycles only

A package is `pretuner.<name>` (a top-level module counts as its own package). Cycles are the
strongly connected components of the graph (Tarjan), printed with one path around each.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pretuner"


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_of(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(path: Path, known: Iterable[str]) -> set[str]:
    """The pretuner modules a file imports anywhere in it (under TYPE_CHECKING excluded: a
    type-only import runs nothing)."""
    return set(_imported(path) & set(known))


@functools.cache
def _imported(path: Path) -> frozenset[str]:
    """Every name a file imports (each file parsed once, for both graphs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return frozenset(found)


def graph(package_level: bool) -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        src = package_of(name) if package_level else name
        for dst in imports(path, mods):
            dst = package_of(dst) if package_level else dst
            if dst != src:
                edges.setdefault(src, set()).add(dst)
        edges.setdefault(src, set())
    return edges


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", action="store_true", help="package cycles only")
    args = ap.parse_args(argv)
    found = [("package", c) for c in cycles(graph(True))]
    if not args.packages:
        found += [("module", c) for c in cycles(graph(False))]
    for level, comp in found:
        print(f"{level} cycle ({len(comp)}): {' <-> '.join(comp)}")
    print(f"{len(found)} cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
