#!/usr/bin/env bash
# Creates (or updates) .venv with PyTorch and every extra (docs too: MkDocs), idempotently.
# torch is pinned and installed first (a torch .venv already has is kept) so that the
# `torch>=2.4` range in pyproject picks no other release. From PyPI on Linux x86-64 it is the
# CUDA build (about 3 GB; it runs on CPUs too): for the CPU-only build, or your own CUDA
# build, install torch into .venv before this (docs/getting-started/local-run.md, "Set up").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# `-I` everywhere: the repo root holds a folder named `operator`, which must never shadow
# the standard library's `operator` module through the current directory on sys.path.
[ -x .venv/bin/python ] || "$PY" -I -m venv .venv
PIP=(.venv/bin/python -I -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
.venv/bin/python -I -c 'import torch' 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e '.[trainer,operator,dev,docs]'
# Byte-compile the project's modules (and the tests' helpers), as pip does for a
# non-editable install: every process that imports them (ranks, profilers, the operator,
# each `cephalo` command) then reads them compiled, also where PYTHONDONTWRITEBYTECODE is
# set and nothing would be written (the trainer's, profiler's, runner's and operator's
# imports: ~0.4 s of CPU less a process, measured). A module edited later is compiled
# afresh in memory, as without this.
.venv/bin/python -I -m compileall -q -j 0 src trainer operator bench tests >/dev/null
