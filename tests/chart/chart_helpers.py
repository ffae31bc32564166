"""Shared by the chart tests: render the chart with the real Helm engine, read RBAC rules."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "cephalo-operator"
RELEASE = "cephalo"
RELEASE_NAMESPACE = "cephalo-system"


@functools.cache
def chart() -> helm.Chart:
    """Loaded once per session: loading goes through the Go library (cheap, but not free)."""
    return helm.Chart.load(CHART_DIR)


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE,
           namespace: str = RELEASE_NAMESPACE) -> list[dict[str, Any]]:
    """Every object `helm install` would create from templates/ (CRDs are not templates)."""
    manifests = chart().render(values or {}, name=name, namespace=namespace, is_install=True)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("__template__", path)  # where it came from, for messages
                objects.append(doc)
    return objects


def strip(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without the test's bookkeeping key."""
    return {k: v for k, v in obj.items() if k != "__template__"}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def container_env(deployment: dict[str, Any]) -> dict[str, str]:
    """The operator container's environment as the kubelet sets it: each value, and the
    downward API's namespace (CEPHALO_OPERATOR_NAMESPACE) as the Deployment's own."""
    env = {}
    for var in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, var
            env[var["name"]] = str(deployment["metadata"]["namespace"])
    return env


@dataclass(frozen=True, order=True)
class Permission:
    """One (apiGroup, resource[/subresource], verb) an RBAC rule grants or a request needs."""

    group: str
    resource: str
    verb: str

    def __str__(self) -> str:
        return f"{self.verb} {self.group or 'core'}/{self.resource}"


def permissions(role: dict[str, Any]) -> set[Permission]:
    """Expand a Role/ClusterRole into single permissions; wildcards are refused outright."""
    granted: set[Permission] = set()
    for rule in role.get("rules") or []:
        assert "nonResourceURLs" not in rule, f"{role['metadata']['name']}: nonResourceURLs"
        # A rule limited to names (the leader election's Lease) counts as the permission:
        # the operator's requests name that object (test_chart_render checks the name).
        assert not rule.get("resourceNames") or rule["resources"] == ["leases"], \
            f"{role['metadata']['name']}: resourceNames on {rule['resources']}"
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field} of {role['metadata']['name']}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add(Permission(group, resource, verb))
    return granted


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())
