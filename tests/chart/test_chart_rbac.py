"""RBAC coverage: the chart's role grants every request the operator makes, and nothing else.

The operator runs exactly as the chart's Deployment starts it (its command line and
environment, rendered by Helm) against the API emulator of tests/operator, which here
*enforces* the rendered RBAC: a request the role does not allow gets 403 Forbidden. One job
goes through profiling, planning, a failed rank and gang restart, success and TTL deletion;
it must finish with nothing denied. What the operator needs is then the union of
* the requests the run recorded (this catches what kopf itself asks for: watches,
  finalizer patches, Events), and
* the operator's source (operator_requests.py): every client call and handler, so that
  branches the run does not take (re-plans, suspend, …) count too;
and every permission the role grants must be in that union.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from chart_helpers import (
    RELEASE_NAMESPACE,
    ROOT,
    Permission,
    by_kind,
    container_env,
    one,
    permissions,
    render,
)
from operator_requests import operator_sites

sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the emulator and kubelet helpers

from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    ExtraPassKubelet,
    OperatorProcess,
    apply_job,
    apply_nodes,
    finish_netprobes,
    finish_profilers,
    job_status,
    pods,
    set_pod,
    wait_for,
)

from cephalo.api import API_GROUP, API_VERSION, KIND, PLURAL

NS = "default"
WAIT_SECONDS = 60.0  # per step; a run takes seconds, but the suite may share a busy machine
JOB = "rbac"
# Two GPU products (two profilers), three ranks: every code path of a mixed cluster, quickly.
NODES = [("l4", "NVIDIA-L4", 2, 23034), ("a6000", "NVIDIA-RTX-A6000", 1, 49140)]
CLUSTER_SCOPED = {("", "nodes"), ("", "namespaces"), ("", "persistentvolumes"),
                  ("apiextensions.k8s.io", "customresourcedefinitions")}
# Fast loops for the test; everything else is the chart's default.
TEST_VALUES: dict[str, Any] = {"operator": {"recheckSeconds": 0.5, "progressIntervalSeconds": 0.5,
                                            "watchTimeoutSeconds": 60}, "logFormat": "plain"}
ELECTION_ROLE = "cephalo-cephalo-operator-leader-election"  # the Lease, in either scope
NETWORK_ROLE = "cephalo-cephalo-operator-network-profiles"  # the probe's cache, either scope
RELEASE_ROLES = {ELECTION_ROLE, NETWORK_ROLE}  # in the release namespace, whatever the scope
SCOPES: dict[str, dict[str, Any]] = {
    "cluster": {},
    "namespaced": {"rbac": {"scope": "namespaced"}, "watchNamespaces": [NS]},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Request:
    permission: Permission
    namespace: str  # '' for cluster-scoped resources and cluster-wide lists/watches

    def __str__(self) -> str:
        return f"{self.permission} in {self.namespace or 'cluster scope'}"


class Rbac:
    """The rendered Roles/ClusterRoles, answering like the API server's RBAC authorizer."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.cluster = set().union(*(permissions(r) for r in by_kind(objects, "ClusterRole")))
        self.namespaced: dict[str, set[Permission]] = {}
        for role in by_kind(objects, "Role"):
            self.namespaced.setdefault(role["metadata"]["namespace"], set()).update(
                permissions(role))

    def allows(self, request: Request) -> bool:
        return request.permission in self.cluster or (
            bool(request.namespace)
            and request.permission in self.namespaced.get(request.namespace, set()))

    def granted(self) -> set[Permission]:
        return self.cluster.union(*self.namespaced.values())


def _request_of(req: Any) -> Request | None:
    """The RBAC view of an emulator request (as kube_emulator records it); None: not ours."""
    if req.headers.get("User-Agent", "").startswith("kmock/"):
        return None  # the test itself, playing the user and the kubelet
    res = req.resource
    if res is None or not res.plural:
        return None  # discovery (/api, /apis, /version): allowed to every authenticated user
    verb = {"GET": "list" if req.name is None else "get", "POST": "create", "PATCH": "patch",
            "PUT": "update", "DELETE": "delete"}[str(req.method.value)]
    if req.params.get("watch") in ("true", "1"):
        verb = "watch"
    resource = res.plural + (f"/{req.subresource}" if req.subresource else "")
    return Request(Permission(res.group or "", resource, verb), req.namespace or "")


class ChartOperator(OperatorProcess):
    """The operator started with the chart Deployment's command, arguments and environment."""

    def __init__(self, kubeconfig: Path, log_path: Path, deployment: dict[str, Any]) -> None:
        super().__init__(kubeconfig, log_path)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        self.argv = [*container["command"], *container["args"]]
        # Never the in-cluster config of a CI pod: only the emulator's kubeconfig.
        ambient = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        self.env = {**ambient, "KUBECONFIG": str(kubeconfig),
                    **container_env(deployment)}

    def start(self) -> ChartOperator:
        assert self.argv[0] == "kopf"
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT)
        return self


async def _one_job_life(api: ApiEmulator) -> None:
    """User and kubelet: a job profiles, measures the network, plans, loses rank 0, restarts,
    succeeds, expires."""
    body = job_body(JOB, backoffLimit=1, ttlSecondsAfterFinished=0)
    await apply_job(api, body)
    await finish_profilers(api, NS, body, count=len({n[1] for n in NODES}),
                           timeout=WAIT_SECONDS)
    # The chart's network probe: L4 <-> A6000 across nodes, then the L4 node's two GPUs.
    await finish_netprobes(api, NS, JOB, count=2, timeout=WAIT_SECONDS)
    world_size = await wait_for("a plan", lambda: (
        job_status(api, NS, JOB).get("plan") or {}).get("worldSize"), WAIT_SECONDS)
    ranks = await wait_for("rank pods", lambda: (
        ps if len(ps := pods(api, NS, "trainer", JOB)) == world_size else None), WAIT_SECONDS)
    # Rank 0 fails → gang restart: every rank pod is deleted and created again.
    await set_pod(api, NS, ranks[0]["metadata"]["name"], "Failed", exit_code=137)
    again = await wait_for("restarted rank pods", lambda: (
        ps if len(ps := pods(api, NS, "trainer", JOB)) == world_size and all(
            p["metadata"]["labels"].get("cephalo.dev/attempt") == "1" for p in ps) else None),
        WAIT_SECONDS)
    for pod in again:
        await set_pod(api, NS, pod["metadata"]["name"], "Running")
    await wait_for("Running", lambda: job_status(api, NS, JOB).get("phase") == "Running",
                   WAIT_SECONDS)
    for pod in again:
        await set_pod(api, NS, pod["metadata"]["name"], "Succeeded")
    # ttlSecondsAfterFinished=0: the operator deletes the finished job itself.
    await wait_for("the job deleted after its TTL", lambda: not any(
        j["metadata"]["name"] == JOB for j in api.list_objects(PLURAL, NS, group=API_GROUP)),
        WAIT_SECONDS)


@dataclass
class Run:
    rbac: Rbac
    requests: set[Request]
    denied: set[Request]


async def _run_under_chart_rbac(scope: str, tmp: Path, stack: AsyncExitStack) -> Run:
    values = {**TEST_VALUES, **SCOPES[scope],
              "metrics": {"port": _free_port()}, "health": {"port": _free_port()}}
    objects = render(values)
    rbac = Rbac(objects)
    seen: set[Request] = set()
    denied: set[Request] = set()

    def forbidden(req: Any) -> bool:
        request = _request_of(req)
        if request is None:
            return False
        seen.add(request)
        if rbac.allows(request):
            return False
        denied.add(request)
        return True

    api = await stack.enter_async_context(ApiEmulator())
    server = await stack.enter_async_context(kmock.Server(api))
    api[forbidden] << kmock.KubernetesError(
        status=403, reason="Forbidden", message="forbidden by the chart's RBAC", details={})
    api.add_resource(API_GROUP, API_VERSION, PLURAL, KIND, shortnames=("cjob",))
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": str(server.url).rstrip("/")}}],
        "users": [{"name": "operator", "user": {"token": "service-account-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "operator"}}],
    }))
    await apply_nodes(api, [gpu_node(*n) for n in NODES] + [gpu_node("cpu-0", None, 0)])
    proc = ChartOperator(kubeconfig, tmp / "operator.log", one(objects, "Deployment"))
    proc.start()
    extra_passes = ExtraPassKubelet(api).start()  # the chart measures beyond-profile sizes
    try:
        await _one_job_life(api)
    except AssertionError as err:
        raise AssertionError(f"{err}; denied by the chart's {scope} RBAC: "
                             f"{sorted(map(str, denied))}\noperator log:\n"
                             f"{proc.log()[-3000:]}") from None
    finally:
        await extra_passes.stop()
        await proc.stop()
    return Run(rbac, seen, denied)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runs(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Run]]:
    # Both installs at once (the operators mostly wait: half the wall time). kmock's servers
    # patch one shared DNS resolver chain, so they must close in reverse order: one stack.
    async with AsyncExitStack() as stack:
        # Let both finish (each stops its operator) before any failure tears the servers down.
        results = await asyncio.gather(*(
            _run_under_chart_rbac(scope, tmp_path_factory.mktemp(scope), stack)
            for scope in SCOPES), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    yield dict(zip(SCOPES, results, strict=True))  # type: ignore[arg-type]


def _needed_from_code() -> dict[Permission, list[str]]:
    needed: dict[Permission, list[str]] = {}
    for site in operator_sites(ROOT / "operator"):
        needed.setdefault(site.permission, []).append(site.where)
    return needed


def _explain(perms: set[Permission]) -> str:
    return ", ".join(str(p) for p in sorted(perms))


@pytest.mark.timeout(900)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("scope", list(SCOPES))
async def test_role_grants_exactly_what_the_operator_uses(runs: dict[str, Run],
                                                         scope: str) -> None:
    run = runs[scope]
    denied = {r.permission for r in run.denied}
    assert not denied, (f"the chart's {scope} RBAC forbade {_explain(denied)}, which the "
                        "operator requested; grant it in templates/rbac.yaml")
    from_code = _needed_from_code()
    recorded = {r.permission for r in run.requests}
    granted = run.rbac.granted()
    missing = set(from_code) - granted
    assert not missing, (f"the chart's {scope} RBAC lacks {_explain(missing)}, which the "
                         f"operator's code requests at {[from_code[p] for p in sorted(missing)]}"
                         "; add it to templates/rbac.yaml")
    unused = granted - recorded - set(from_code)
    assert not unused, (f"the chart's {scope} RBAC grants {_explain(unused)}, which the "
                        "operator never requests: remove it from templates/rbac.yaml")
    # The run must have exercised the core of the lifecycle, or it proves little.
    for perm in ("create core/pods", "delete core/pods", "patch cephalo.dev/cephalojobs/status",
                 "watch cephalo.dev/cephalojobs", "list core/nodes", "create core/events",
                 "delete cephalo.dev/cephalojobs"):
        assert perm in {str(p) for p in recorded}, f"the end-to-end run never did {perm}"


def test_enforcement_denies_what_the_role_lacks() -> None:
    """The authorizer the runs rely on: namespaces, cluster scope and subresources."""
    rbac = Rbac(render(SCOPES["namespaced"]))
    pods_list = Permission("", "pods", "list")
    assert rbac.allows(Request(pods_list, NS))
    assert not rbac.allows(Request(pods_list, "other"))
    assert not rbac.allows(Request(pods_list, ""))  # cluster-wide list needs a ClusterRole
    assert rbac.allows(Request(Permission("", "nodes", "watch"), ""))
    assert not rbac.allows(Request(Permission(API_GROUP, PLURAL + "/status", "update"), NS))
    assert not rbac.allows(Request(Permission("", "secrets", "get"), NS))


def test_namespaced_scope_splits_the_same_rules() -> None:
    """Roles in each watched namespace for namespaced resources, a ClusterRole for the rest."""
    namespaces = ["team-a", "team-b"]
    cluster_mode = permissions(one(render(), "ClusterRole"))
    objects = render({"rbac": {"scope": "namespaced"}, "watchNamespaces": namespaces})
    cluster_part = permissions(one(objects, "ClusterRole"))
    roles = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] not in RELEASE_ROLES]
    assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces
    assert all((p.group, p.resource) in CLUSTER_SCOPED for p in cluster_part), \
        f"namespaced mode grants namespaced resources cluster-wide: {_explain(cluster_part)}"
    # kopf lists and watches Namespace objects only when given namespaces to watch.
    namespaces_read = {Permission("", "namespaces", "list"), Permission("", "namespaces", "watch")}
    assert namespaces_read <= cluster_part and not namespaces_read & cluster_mode
    for role in roles:
        assert (cluster_part - namespaces_read) | permissions(role) == cluster_mode
    bindings = {(b["metadata"]["namespace"], b["roleRef"]["name"])
                for b in by_kind(objects, "RoleBinding")
                if b["roleRef"]["name"] not in RELEASE_ROLES}
    assert bindings == {(ns, roles[0]["metadata"]["name"]) for ns in namespaces}


@pytest.mark.parametrize("scope", list(SCOPES))
def test_the_network_cache_is_read_in_the_release_namespace_only(scope: str) -> None:
    """Issue 46 item 5: the probe's cache is listed in the operator's namespace (a Role
    there); no ClusterRole lets the operator list every namespace's ConfigMaps."""
    objects = render(SCOPES[scope])
    configmaps_list = Permission("", "configmaps", "list")
    assert not any(configmaps_list in permissions(r) for r in by_kind(objects, "ClusterRole"))
    holders = [r for r in by_kind(objects, "Role") if configmaps_list in permissions(r)]
    assert [(r["metadata"]["name"], r["metadata"]["namespace"]) for r in holders] == [
        (NETWORK_ROLE, RELEASE_NAMESPACE)]
    assert {(p.group, p.resource) for p in permissions(holders[0])} == {("", "configmaps")}
    rbac = Rbac(objects)
    assert rbac.allows(Request(configmaps_list, RELEASE_NAMESPACE))
    assert not rbac.allows(Request(configmaps_list, NS))
    # The Deployment tells the operator its namespace through the downward API.
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    (var,) = [e for e in container["env"] if e["name"] == "CEPHALO_OPERATOR_NAMESPACE"]
    assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_rbac_disabled_renders_no_roles() -> None:
    objects = render({"rbac": {"create": False}})
    assert not {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"} & \
        {o["kind"] for o in objects}


def test_bindings_name_the_operator_service_account() -> None:
    objects = render({"rbac": {"scope": "namespaced"}, "watchNamespaces": ["a"]})
    sa = one(objects, "ServiceAccount")["metadata"]
    pod_sa = one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert pod_sa == sa["name"]
    for binding in by_kind(objects, "RoleBinding") + by_kind(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"],
                                        "namespace": sa["namespace"]}]
