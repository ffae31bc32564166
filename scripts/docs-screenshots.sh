#!/usr/bin/env bash
# Screenshots of the built documentation site (issue 37): the home page and one generated
# reference page, with headless Chromium from Debian's packages (apt-get install -y chromium),
# written to docs/images/. Run after a change to the theme or the pages' look.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v chromium >/dev/null || { echo "no chromium: apt-get install -y chromium" >&2; exit 2; }
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
shoot() {  # page (under the site), image name
    # --no-sandbox: Chromium's sandbox needs user namespaces, absent in most CI containers.
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,900 \
        --screenshot="docs/images/$2" "file://$site/$1" 2>/dev/null
}
shoot index.html site-home.png
shoot reference/cephalojob/index.html site-reference-cephalojob.png
ls -l docs/images/site-*.png
