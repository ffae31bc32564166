"""The one YAML reader: hostile shapes are refused with one line, ordinary YAML (anchors
included) loads exactly as yaml.safe_load does."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cephalo.api.safeyaml import (
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    YamlError,
    load_yaml_file,
    parse_yaml,
)
from cephalo.errors import CephaloError


def _bomb(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_ordinary_yaml_and_anchors_load_like_safe_load() -> None:
    text = "base: &b {x: 1, y: [1, 2]}\nfirst: *b\nsecond: {<<: *b, y: 3}\nz: .inf\n"
    assert parse_yaml(text, "t") == yaml.safe_load(text)
    assert parse_yaml(_bomb(3), "t") == yaml.safe_load(_bomb(3))  # 9^3: fine


def test_alias_bomb_is_refused_before_anything_walks_it() -> None:
    with pytest.raises(YamlError, match=r"^t: expands to more than 100000 nodes"):
        parse_yaml(_bomb(9), "t")


def test_depth_is_bounded_without_recursion_errors() -> None:
    assert parse_yaml("[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH, "t") is not None
    for text in ("[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1),
                 "x: " + "[" * 50_000 + "]" * 50_000, "{a: " * 30_000 + "1" + "}" * 30_000):
        with pytest.raises(YamlError, match=f"nested deeper than {MAX_YAML_DEPTH} levels"):
            parse_yaml(text, "t")


def test_size_is_bounded() -> None:
    with pytest.raises(YamlError, match="larger than 1 MiB"):
        parse_yaml("x: " + "y" * MAX_YAML_BYTES, "t")


def test_file_errors_are_one_line_cephalo_errors(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "binary").write_bytes(b"\x80\x81")
    (tmp_path / "bad").write_text("a: [1,\n  b")
    for name, message in (("missing", "no such file"), ("folder", "is a folder"),
                          ("binary", "not UTF-8 text"), ("bad", "not valid YAML at line")):
        with pytest.raises(CephaloError) as info:
            load_yaml_file(str(tmp_path / name))
        assert message in str(info.value) and "\n" not in str(info.value)


def test_cephalo_error_is_always_one_line() -> None:
    assert str(CephaloError("a\n  b\tc ")) == "a b c"
