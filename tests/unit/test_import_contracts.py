"""The layer rules of docs/architecture.md on the whole import graph, by import-linter.

`tests/unit/test_layering.py` checks what importing the top packages loads at run time;
this checks every module, including imports inside functions and modules nothing imports
yet. import-linter's graph builder (grimp) walks one folder per root package, but the
distribution maps `cephalo.operator` and `cephalo.trainer` from folders outside
`src/cephalo` (pyproject's package-dir), so the test lays the sources out as installed
(a copy under tmp_path) and runs `lint-imports` there with pyproject's contracts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _installed_layout(dest: Path) -> Path:
    """Copy every mapped package folder to where an installed `cephalo` would have it."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    for package, folder in sorted(package_dir.items()):  # parents before children
        target = dest.joinpath(*package.split("."))
        shutil.copytree(ROOT / folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "pyproject.toml"], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    return _installed_layout(tmp_path_factory.mktemp("installed"))


def test_layer_contracts_are_kept(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
    # the mapped packages were really analysed, not silently missing
    assert (tree / "cephalo" / "operator" / "reconcile.py").exists()
    assert (tree / "cephalo" / "trainer" / "engine.py").exists()


def test_a_kubernetes_import_deep_in_the_trainer_breaks_the_contract(tree: Path,
                                                                     tmp_path: Path) -> None:
    broken = _installed_layout(tmp_path / "broken")
    engine = broken / "cephalo" / "trainer" / "engine.py"
    engine.write_text("import kubernetes  # injected by the test\n" + engine.read_text())
    result = _lint(broken)
    assert result.returncode != 0
    assert "cephalo.trainer.engine -> kubernetes" in result.stdout


def test_a_torch_import_in_a_planner_function_breaks_the_contract(tmp_path: Path,
                                                                  tree: Path) -> None:
    broken = _installed_layout(tmp_path / "broken")
    solver = broken / "cephalo" / "planner" / "search" / "solver.py"
    solver.write_text(solver.read_text() + "\n\ndef _injected() -> None:\n    import torch\n")
    result = _lint(broken)
    assert result.returncode != 0
    assert "cephalo.planner.search.solver -> torch" in result.stdout
