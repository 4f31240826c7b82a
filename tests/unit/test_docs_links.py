"""Every relative link of the README and the docs resolves: the file exists, and a `#heading` anchor names a
heading of that file (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", CODE_BLOCK.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_anchor_rule():
    page = REPO / "docs" / "benchmarks.md"
    assert "model-loading-memory" in anchors(page)
    assert "Model loading memory" not in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_readme_stays_a_guide():
    """README.md is the user's guide, at most 300 lines; depth goes to docs/ (linked)."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move the depth to docs/"
