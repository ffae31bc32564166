#!/usr/bin/env bash
# Creates (or updates) .venv with the CPU build of PyTorch and every extra, idempotently.
# The CPU torch is installed first so that the `torch>=2.4` range in pyproject does not pull
# a multi-GB CUDA build; on a GPU machine install your CUDA torch instead before this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
.venv/bin/python -c 'import torch' 2>/dev/null || \
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[trainer,operator,dev]'
