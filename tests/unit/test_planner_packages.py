"""The planner's own import graph (docs/architecture.md, "The planner's layout"): read from the
sources with `ast`, every import counted (inside functions and under `if TYPE_CHECKING:` too,
since a type-only import still ties two modules together for a reader), it has no circle, and
no sub-package imports one above it: cost <- search <- outputs, feedback.

`tests/unit/test_layering.py` and `test_import_contracts.py` check what the planner may import
from outside; this checks the planner inside."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PLANNER = Path(__file__).resolve().parents[2] / "src" / "cephalo" / "planner"
PACKAGE = "cephalo.planner"

# Each sub-package's rank: a module may import its own sub-package's modules and those of a
# lower rank, never a higher one nor a sibling of the same rank (outputs and feedback are
# independent of each other).
LAYERS = {"cost": 0, "search": 1, "outputs": 2, "feedback": 2}
# The modules above every layer: the public API and the process shell the operator runs.
TOP = {PACKAGE, f"{PACKAGE}.worker"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLANNER).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PLANNER.rglob("*.py"))}


def _imported(name: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """The planner modules that module `name` (its `source`) imports: `from a.b import c` is
    module a.b.c where that is a module, else a.b; a relative import is resolved against the
    module's package (`name` itself where `is_package`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                anchor = package[:len(package) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path.read_text(), path.name == "__init__.py", set(modules))
            for name, path in modules.items()}


def _layer(module: str) -> str | None:
    """The sub-package `module` lives in (None for the top modules)."""
    if module in TOP:
        return None
    return module.removeprefix(f"{PACKAGE}.").split(".")[0]


def test_the_planner_sources_are_found() -> None:
    # A wrong path would make every other check here pass on nothing.
    graph = _graph()
    assert len(graph) > 20
    assert sum(len(targets) for targets in graph.values()) > 40


def test_the_planners_imports_have_no_circle() -> None:
    try:
        tuple(graphlib.TopologicalSorter(_graph()).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import circle in the planner: {' -> '.join(err.args[1])}")


def test_every_planner_module_lives_in_a_layer() -> None:
    stray = sorted(m for m in _graph() if m not in TOP and _layer(m) not in LAYERS)
    assert stray == [], f"planner modules outside the sub-packages {sorted(LAYERS)}: {stray}"


def test_no_planner_sub_package_imports_upward_or_sideways() -> None:
    wrong = []
    for module, targets in sorted(_graph().items()):
        own = _layer(module)
        if own not in LAYERS:
            continue
        for target in sorted(targets):
            theirs = _layer(target)
            if theirs == own:
                continue
            if theirs not in LAYERS or LAYERS[theirs] >= LAYERS[own]:
                wrong.append(f"{module} imports {target}")
    assert wrong == [], "imports against the planner's layering (cost <- search <- outputs, " \
                        f"feedback): {wrong}"


def test_the_import_reader_resolves_what_python_would() -> None:
    # The reader itself, on a module written for the purpose: a relative import, a
    # submodule through `from package import module`, and one under TYPE_CHECKING.
    modules = {f"{PACKAGE}.cost", f"{PACKAGE}.cost.catalog", f"{PACKAGE}.search",
               f"{PACKAGE}.search.lagrange", f"{PACKAGE}.search.problem"}
    source = ("from typing import TYPE_CHECKING\n"
              "from . import lagrange\n"
              "from ..cost.catalog import GpuType\n"
              "if TYPE_CHECKING:\n"
              "    from cephalo.planner.search.problem import Problem\n"
              "import numpy\n")
    got = _imported(f"{PACKAGE}.search.bottleneck", source, False, modules)
    assert got == {f"{PACKAGE}.search.lagrange", f"{PACKAGE}.cost.catalog",
                   f"{PACKAGE}.search.problem"}
