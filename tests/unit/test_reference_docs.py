"""The generated reference pages of the docs site (issue 37): docs/reference/*.md are what
scripts/gen-reference.py writes from the code now, and each covers what a source it did not
read from names: the committed CRD file, argparse's own help, values.yaml, the Grafana
dashboard's queries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.load_file import load_file

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference"
CHART = REPO / "charts" / "cephalo-operator"


GEN = load_file(REPO / "scripts" / "gen-reference.py", "gen_reference")


@pytest.mark.parametrize("name", sorted(GEN.PAGES))
def test_the_committed_page_is_what_the_code_generates(name: str) -> None:
    committed = REFERENCE / name
    assert committed.is_file(), f"docs/reference/{name} is missing: run {GEN.COMMAND}"
    assert committed.read_text() == GEN.PAGES[name](), (
        f"docs/reference/{name} is stale (the code changed since it was generated): "
        f"run .venv/bin/{GEN.COMMAND} and commit the result")


def _section(page: str, heading: str) -> str:
    """The text under one `### heading` (or `## heading`) up to the next heading."""
    start = page.index(heading)
    rest = page[start + len(heading):]
    end = re.search(r"^#{2,3} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def test_every_field_of_the_committed_crd_has_a_row() -> None:
    crd = yaml.safe_load((REPO / "crds" / "cephalojob.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    page = (REFERENCE / "cephalojob.md").read_text()
    missing = []

    def walk(path: str, node: dict[str, Any]) -> None:
        section = _section(page, f"### `{path}`")
        for name, sub in node["properties"].items():
            if f"| `{name}`" not in section:
                missing.append(f"{path}.{name}")
            child, suffix = sub, ""
            if child.get("type") == "array":
                child, suffix = child["items"], "[]"
            elif "properties" not in child and isinstance(child.get("additionalProperties"),
                                                          dict):
                child, suffix = child["additionalProperties"], "{}"
            if "properties" in child:
                walk(f"{path}.{name}{suffix}", child)
    walk("spec", schema["properties"]["spec"])
    walk("status", schema["properties"]["status"])
    assert missing == []


def test_every_flag_argparse_prints_is_in_the_command_reference() -> None:
    from cephalo.cli import build_parser

    commands: dict[str, Any] = {}
    build_parser(commands=commands)
    page = (REFERENCE / "cli.md").read_text()
    for name, parser in commands.items():
        section = _section(page, f"## `cephalo {name}`")
        # argparse's own help text: every option it shows, in its options list
        options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_help()))
        missing = [o for o in options - {"-h", "--help"} if f"`{o}" not in section]
        assert missing == [], f"cephalo {name}: {missing}"


def test_every_value_of_values_yaml_is_in_the_values_reference() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    page = (REFERENCE / "chart-values.md").read_text()

    def leaves(node: Any, prefix: str) -> list[str]:
        """Each value's key, or the key of the map it is an entry of (`resources.requests`)."""
        if isinstance(node, dict) and node and f"| `{prefix.rstrip('.')}` |" not in page:
            return [leaf for key, value in node.items()
                    for leaf in leaves(value, f"{prefix}{key}.")]
        return [prefix.rstrip(".")]
    keys = [k for k in leaves(defaults, "") if not k.startswith("global")]
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert missing == [] and len(keys) > 30, missing


def test_every_metric_the_dashboard_queries_is_in_the_metrics_reference() -> None:
    dashboard = json.dumps(json.loads((CHART / "dashboards" / "cephalo.json").read_text()))
    page = (REFERENCE / "metrics.md").read_text()
    names = {re.sub(r"_(bucket|sum|count)$", "", n)
             for n in re.findall(r"\bcephalo_[a-z_]+", dashboard)}
    labels = {"cephalo_namespace", "cephalo_job"}
    missing = sorted(n for n in names - labels if f"| `{n}` |" not in page)
    assert missing == [] and len(names) > 15, missing
