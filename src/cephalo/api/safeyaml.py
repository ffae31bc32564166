"""The one YAML reader for user files: bounded in size, nesting depth and alias expansion.

`yaml.safe_load` builds no arbitrary objects, but it is not safe against hostile *shapes*:
a 578-byte "billion laughs" alias bomb loads in microseconds as shared references and then
explodes (5.8 GB) in whatever walks it — validation, a dump, a copy; 20k nested `[` overflow
the composer's recursion; a 100 MB scalar is read whole. A CephaloJob is a few kilobytes and a
dozen levels deep, so the limits here are far beyond any real file.
"""

from __future__ import annotations

from typing import Any

import yaml

from cephalo.errors import CephaloError

MAX_YAML_BYTES = 1024**2
MAX_YAML_DEPTH = 64
# Nodes after expanding every alias (each use of an anchor counts its whole subtree again).
MAX_YAML_EXPANDED_NODES = 100_000


class YamlError(CephaloError, ValueError):
    """A YAML input that cannot be read: one line, where and why."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than MAX_YAML_DEPTH while composing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlError(f"nested deeper than {MAX_YAML_DEPTH} levels at line "
                                f"{mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_nodes(node: yaml.Node, memo: dict[int, int]) -> int:
    """Size of the node tree with aliases expanded; shared nodes are measured once (memo),
    so this is linear in the file even for a bomb."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = 1  # a cycle (a recursive alias) counts once and stops
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_nodes(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_nodes(k, memo) + _expanded_nodes(v, memo)
                        for k, v in node.value)
    else:
        total = 1
    memo[key] = min(total, MAX_YAML_EXPANDED_NODES + 1)
    return memo[key]


def parse_yaml(text: str, source: str) -> Any:
    """One YAML document from text, within the limits; YamlError names source and problem."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise YamlError(f"{source}: larger than {MAX_YAML_BYTES // 1024**2} MiB; a CephaloJob "
                        "is a few kilobytes")
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node, {}) > MAX_YAML_EXPANDED_NODES:
            raise YamlError(f"{source}: expands to more than {MAX_YAML_EXPANDED_NODES} nodes "
                            "through aliases (&anchor/*alias); write the values out")
        return loader.construct_document(node)
    except YamlError as err:
        if str(err).startswith(source):
            raise
        raise YamlError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise YamlError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:  # a construct we did not bound; never a traceback
        raise YamlError(f"{source}: nested too deeply") from None
    finally:
        loader.dispose()


def read_text_file(path: str, max_bytes: int = MAX_YAML_BYTES, what: str = "file") -> str:
    """A small UTF-8 text file, or a one-line error saying why it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise YamlError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise YamlError(f"{path}: is a folder; give the {what} inside it") from None
    except OSError as err:
        raise YamlError(f"{path}: cannot read: {err.strerror or err}") from None
    if len(data) > max_bytes:
        raise YamlError(f"{path}: larger than {max_bytes // 1024**2} MiB; not a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise YamlError(f"{path}: not UTF-8 text (byte {err.start}); not a {what}") from None


def load_yaml_file(path: str, what: str = "YAML file") -> Any:
    """Read and parse a YAML file within the limits."""
    return parse_yaml(read_text_file(path, what=what), path)
