"""MkDocs hook (mkdocs.yml `hooks:`): links from a docs page to the repository's own files.

The pages link source, examples and tests by relative path (`../src/cephalo/cli.py`), which
reads right on GitHub and in an editor but lies outside the site's docs/ folder. Here such a
link becomes a link to the file in the repository (`repo_url`/blob/main/...), and one to a
file that does not exist is a warning, which the strict build turns into a failure: the
link check covers these links too, not only links between pages.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

LOG = logging.getLogger("mkdocs.hooks.repo_links")
# [text](target) and [text](target "title"), not images' sources inside code spans.
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _rewrite(markdown: str, page_dir: Path, docs_dir: Path, repo: Path, repo_url: str,
             page: str) -> str:
    def one(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):
            return match.group(0)
        path_part, _, anchor = target.partition("#")
        path = (page_dir / path_part).resolve()
        if path.is_relative_to(docs_dir) or not path.is_relative_to(repo):
            return match.group(0)  # MkDocs checks links between pages itself
        if not path.exists():
            LOG.warning("%s links %s, which is not in the repository", page, target)
            return match.group(0)
        kind = "tree" if path.is_dir() else "blob"
        url = f"{repo_url.rstrip('/')}/{kind}/main/{path.relative_to(repo).as_posix()}"
        return f"{match.group(1)}{url}{'#' + anchor if anchor else ''}{match.group(3)}"

    # Code blocks are left as written.
    pieces, last = [], 0
    for fence in FENCE.finditer(markdown):
        pieces += [LINK.sub(one, markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    pieces.append(LINK.sub(one, markdown[last:]))
    return "".join(pieces)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    page_dir = (docs_dir / page.file.src_path).parent
    return _rewrite(markdown, page_dir, docs_dir, repo, config["repo_url"] or "",
                    page.file.src_path)
