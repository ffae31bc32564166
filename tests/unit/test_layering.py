"""Layer rules of docs/architecture.md: the operator's side never imports torch, the trainer never
imports kopf or kubernetes. Checked in a fresh interpreter so nothing is preloaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})
print(','.join(bad))
"""


def _loaded(modules: list[str], forbidden: list[str]) -> str:
    code = _CHECK.format(modules=modules, forbidden=forbidden)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600)
    return out.stdout.strip()


def test_api_planner_and_cli_are_torch_free() -> None:
    modules = ["cephalo.api", "cephalo.planner", "cephalo.cli", "cephalo.commands.plan"]
    assert _loaded(modules, ["torch"]) == ""


def test_operator_is_torch_free() -> None:
    pytest.importorskip("kopf")
    try:
        import cephalo.operator  # noqa: F401
    except ImportError as err:  # pragma: no cover - only while the operator is being built
        pytest.skip(f"cephalo.operator not importable: {err}")
    assert _loaded(["cephalo.operator", "cephalo.client"], ["torch"]) == ""


def test_trainer_is_kubernetes_free() -> None:
    pytest.importorskip("torch")
    assert _loaded(["cephalo.trainer"], ["kopf", "kubernetes", "kmock"]) == ""
