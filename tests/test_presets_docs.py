"""CI check: the committed docs/presets.md is what `pretuner presets docs` renders."""

from __future__ import annotations

from pathlib import Path

from pretuner.presets.catalog import CATALOG_COMMAND, catalog_markdown
from pretuner.presets.model import builtin_presets

DOCS = Path(__file__).parent.parent / "docs" / "presets.md"


def test_docs_presets_md_is_current() -> None:
    want = catalog_markdown(builtin_presets())
    have = DOCS.read_text("utf-8") if DOCS.exists() else ""
    assert have == want, f"docs/presets.md is stale; refresh it with: {CATALOG_COMMAND}"
