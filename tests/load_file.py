"""A module loaded from a file that is not in a package (scripts/gen-reference.py, whose name
is no identifier; scripts/mkdocs_hooks.py, which MkDocs loads by path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up while it is made
    spec.loader.exec_module(module)
    return module
