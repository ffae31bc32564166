"""The documentation a clone carries (issue 26 item 11): every relative link resolves inside
the repository (README linked ../shared/DESIGN.md, a file outside it), and the architecture
is the repository's own docs/architecture.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "operator" / "README.md",
        *sorted((REPO / "charts").glob("*/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_stay_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO), f"{doc.name} links {target}, outside the repository"
        assert path.exists(), f"{doc.name} links {target}, which does not exist"
    assert "DESIGN.md" not in text, f"{doc.name} names DESIGN.md, which is not in a clone"


def test_readme_links_the_architecture() -> None:
    assert "](docs/architecture.md)" in (REPO / "README.md").read_text()
