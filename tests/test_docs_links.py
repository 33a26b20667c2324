"""Every relative link of README.md and docs/ (results included) names a file or folder that exists, and every
``#anchor`` into a Markdown file names one of its headings (GitHub's anchor rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto:


def test_there_are_docs_with_links():
    assert len(DOCS) >= 10 and sum(len(_links(d)) for d in DOCS) >= 50


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(md):
    broken = []
    for target in _links(md):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if REPO not in dest.parents and dest != REPO:
            continue  # outside the checkout (../shared beside it on the project's machines): not the repo's to check
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert broken == []


def test_anchor_rule():
    assert _anchor("Performance (4-GPU mission suite)") == "performance-4-gpu-mission-suite"
    assert _anchor("FP8 KV cache") == "fp8-kv-cache"
