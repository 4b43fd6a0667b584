"""Every relative link in the README and docs/*.md points at a file that exists in the repository."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_targets(page):
    for m in LINK.finditer(page.read_text()):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor inside the page
        yield target.split("#")[0]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    missing = [t for t in _relative_targets(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files {missing}"


def test_design_document_is_in_the_repository():
    text = (ROOT / "docs" / "design.md").read_text()
    for section in (
        "## Numerics",
        "## API conventions",
        "## Validation and nothing lost",
        "## Testing",
        "## Benchmarks",
        "### Results format",
        "## Real model and data",
    ):
        assert section in text, f"docs/design.md lacks the section {section!r} that the code cites"
