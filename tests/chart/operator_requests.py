"""The Kubernetes requests the operator's code can make, read from its source (ast).

An end-to-end run only sees the paths it drives; a rarely taken branch (a TTL that deletes
the job, a re-plan that deletes the plan ConfigMap) would be missed. So the RBAC test
also reads every call of the operator's client, `<…>.kube.<verb>(path)` where the path is
built by `core_path(namespace, plural, name, subresource)` or `job_path(namespace, name,
subresource)`, every `kopf.event(...)` (an Event create) and every kopf handler decorator
(a list and a watch of its resource). A call whose resource cannot be read is an error,
so a new way of building paths fails the test instead of silently escaping it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from chart_helpers import Permission

from cephalo.api import API_GROUP, PLURAL
from cephalo.operator.gang import POD_GROUP_APIS

# Client method → RBAC verbs. `create` is create-if-absent: it GETs the object on a 409.
CLIENT_VERBS: dict[str, tuple[str, ...]] = {
    "get": ("get",), "list": ("list",), "create": ("create", "get"),
    "patch": ("patch",), "delete": ("delete",),
}
KOPF_HANDLERS = {"on", "daemon", "timer", "index"}
CLIENT_MODULE = "kube.py"  # defines the client: its own calls take the path as a parameter


@dataclass(frozen=True)
class Site:
    permission: Permission
    where: str  # file:line, for messages


class UnreadableCall(AssertionError):
    pass


def _const(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _resource(call: ast.Call) -> tuple[str, str] | None:
    """(group, resource[/sub]) of a core_path/job_path call, None for other calls."""
    name = call.func.id if isinstance(call.func, ast.Name) else None
    args = list(call.args) + [None] * 4
    kw = {k.arg: k.value for k in call.keywords}
    if name == "core_path":
        plural, sub = _const(args[1] or kw.get("plural")), args[3] or kw.get("subresource")
        if plural is None:
            return None
        return "", plural + (f"/{_const(sub)}" if _const(sub) else "")
    if name == "job_path":
        sub = args[2] or kw.get("subresource")
        return API_GROUP, PLURAL + (f"/{_const(sub)}" if _const(sub) else "")
    if name == "pod_groups_path":  # cephalo.operator.gang: either PodGroup API, by the job
        return "|".join(sorted(a.group for a in POD_GROUP_APIS.values())), "podgroups"
    if name == "network_policies_path":  # cephalo.operator.netpol
        return "networking.k8s.io", "networkpolicies"
    return None


class _FunctionScan(ast.NodeVisitor):
    def __init__(self, file: str) -> None:
        self.file = file
        self.assigned: dict[str, tuple[str, str]] = {}  # local name → resource of its path
        self.sites: list[Site] = []

    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Call) and (res := _resource(node.value)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.assigned[target.id] = res
        self.generic_visit(node)

    def _path_resource(self, node: ast.expr) -> tuple[str, str] | None:
        if isinstance(node, ast.Call):
            return _resource(node)
        if isinstance(node, ast.Name):
            return self.assigned.get(node.id)
        if isinstance(node, ast.JoinedStr) and node.values:  # f"{pods_path}/{name}"
            head = node.values[0]
            if isinstance(head, ast.FormattedValue):
                return self._path_resource(head.value)
        return None

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        where = f"{self.file}:{node.lineno}"
        if isinstance(func, ast.Attribute) and func.attr in CLIENT_VERBS and \
                ast.unparse(func.value).split(".")[-1] == "kube":
            res = self._path_resource(node.args[0]) if node.args else None
            if res is None:
                raise UnreadableCall(
                    f"{where}: cannot tell which resource {ast.unparse(node)[:80]} touches; "
                    "build its path with core_path/job_path (or teach "
                    "tests/chart/operator_requests.py)")
            for verb in CLIENT_VERBS[func.attr]:
                for group in res[0].split("|"):
                    self.sites.append(Site(Permission(group, res[1], verb), where))
        elif ast.unparse(func) == "kopf.event":
            self.sites.append(Site(Permission("", "events", "create"), where))
        self.generic_visit(node)


def _handler_sites(tree: ast.Module, file: str, constants: dict[str, str]) -> list[Site]:
    """kopf handler decorators: kopf lists and watches the resource each one names."""
    sites: list[Site] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            parts = ast.unparse(dec.func).split(".")
            if parts[0] != "kopf" or len(parts) < 2 or parts[1] not in KOPF_HANDLERS:
                continue
            if parts[-1] in ("startup", "cleanup", "login", "probe"):
                continue  # operator-level handlers: no resource
            args = [(_const(a) if _const(a) is not None else constants.get(ast.unparse(a)))
                    for a in dec.args]
            if len(args) < 3 or None in args[:3]:
                raise UnreadableCall(f"{file}:{dec.lineno}: cannot read the resource of "
                                     f"{ast.unparse(dec)[:80]}")
            group, plural = args[0], args[2]
            for verb in ("list", "watch"):
                sites.append(Site(Permission(group or "", plural or "", verb),
                                  f"{file}:{dec.lineno}"))
    return sites


def operator_sites(package_dir: Path) -> list[Site]:
    """Every request site in the operator package (one Site per verb per call)."""
    constants = {"API_GROUP": API_GROUP, "PLURAL": PLURAL, "API_VERSION": "v1alpha1"}
    sites: list[Site] = []
    for path in sorted(package_dir.glob("*.py")):
        if path.name == CLIENT_MODULE:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                scan = _FunctionScan(path.name)
                for stmt in node.body:
                    scan.visit(stmt)
                sites.extend(scan.sites)
        sites.extend(_handler_sites(tree, path.name, constants))
    # Nested functions are walked twice (once inside their parent): keep each site once.
    return sorted(set(sites), key=lambda s: (s.permission, s.where))
