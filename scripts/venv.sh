#!/usr/bin/env bash
# Creates (or updates) .venv with the CPU build of PyTorch and every extra, idempotently.
# The CPU torch is installed first so that the `torch>=2.4` range in pyproject does not pull
# a multi-GB CUDA build; on a GPU machine install your CUDA torch instead before this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# `-I` everywhere: the repo root holds a folder named `operator`, which must never shadow
# the standard library's `operator` module through the current directory on sys.path.
[ -x .venv/bin/python ] || "$PY" -I -m venv .venv
PIP=(.venv/bin/python -I -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
.venv/bin/python -I -c 'import torch' 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e '.[trainer,operator,dev]'
