"""The documentation site (issue 37): `mkdocs build --strict` succeeds, so a broken link
between pages, a missing page or anchor, a snippet of a file that is gone, or a link to a
repository file that does not exist fails the suite. `.ci/run` builds the site itself (timed)
and then sets CEPHALO_SITE_BUILT=1, so CI builds it once."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.load_file import load_file

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("material") is None,
                    reason="MkDocs is not installed (pip install -e '.[docs]')")
@pytest.mark.skipif(os.environ.get("CEPHALO_SITE_BUILT") == "1",
                    reason="built strictly by .ci/run in this CI run")
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(site)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300,
                          check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for page in (REPO / "docs").rglob("*.md"):  # a/b.md -> a/b/index.html, a/index.md -> a/
        name = page.relative_to(REPO / "docs").with_suffix("")
        folder = name.parent if name.name == "index" else name
        assert (site / folder / "index.html").is_file(), f"{page.name} was not built"
    # The chart README's sections are shown, not their markers.
    install = (site / "getting-started" / "cluster-install" / "index.html").read_text()
    assert "Prerequisites: GPU nodes labelled by GPU Feature Discovery" in install
    assert "--8&lt;--" not in install


def test_links_to_repository_files_become_repository_links(tmp_path: Path, caplog) -> None:
    """The hook leaves links between pages and inside code to MkDocs, turns a link to a file
    of the repository into its address there, and warns (so the strict build fails) on a
    file that does not exist."""
    hooks = load_file(REPO / "scripts" / "mkdocs_hooks.py", "mkdocs_hooks")
    docs = REPO / "docs"
    text = ("[a](../../examples/quickstart.yaml#L3) [b](planning.md) [c](../../src/cephalo) "
            "[d](../../no/such/file.py) [e](https://x.org/y)\n```\n[f](../../README.md)\n```\n")
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.repo_links"):
        out = hooks._rewrite(text, docs / "guide", docs.resolve(), REPO, "https://r.example/o/c",
                             "guide/x.md")
    assert "(https://r.example/o/c/blob/main/examples/quickstart.yaml#L3)" in out
    assert "(https://r.example/o/c/tree/main/src/cephalo)" in out
    assert "[b](planning.md)" in out and "[e](https://x.org/y)" in out
    assert "[f](../../README.md)" in out  # inside a code block: as written
    assert [r.getMessage() for r in caplog.records] == [
        "guide/x.md links ../../no/such/file.py, which is not in the repository"]


def test_the_strict_checks_are_on_and_ci_sees_them() -> None:
    """What makes the build fail is configuration: strict, and each link check at `warn`
    (`info` would let it pass). And `mkdocs build --quiet` hides the warnings from the
    strict count too: a broken link built with --strict --quiet exited 0."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)
    assert config["strict"] is True
    validation = config["validation"]
    assert validation["nav"]["not_found"] == "warn"
    assert {validation["links"][k] for k in ("not_found", "anchors", "unrecognized_links")} \
        == {"warn"}
    builds = [line for path in (".ci/run", "scripts/docs-screenshots.sh")
              for line in (REPO / path).read_text().splitlines() if "bin/mkdocs build" in line]
    assert len(builds) == 2 and all("--strict" in b and "--quiet" not in b and " -q" not in b
                                    for b in builds), builds
