"""NetworkPolicies and namespaced RBAC: who can reach which port, decided the way Kubernetes
decides it (https://kubernetes.io/docs/concepts/services-networking/network-policies/):

* a pod is isolated for ingress when some policy in its namespace selects it with `Ingress`
  in policyTypes; an isolated pod accepts a connection when any such policy has an ingress
  rule whose `from` matches the source (no `from`: any source) and whose `ports` match (no
  `ports`: every port); a pod no policy selects accepts everything;
* a peer with only `podSelector` matches pods in the policy's namespace; with only
  `namespaceSelector`, every pod of the matching namespaces; with both, the pods matching
  the podSelector in the matching namespaces.

The policies are the chart's (rendered by Helm) and the per-job one the operator makes
(cephalo.operator.netpol), with rank pods as the operator renders them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import helm_python as helm
import pytest
from chart_helpers import (
    RELEASE_NAMESPACE,
    ROOT,
    by_kind,
    container_env,
    one,
    permissions,
    render,
    strip,
)
from kubernetes_validate import utils as kubernetes_validate

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from kube_fixtures import job_body

from cephalo.api import Plan, parse_job
from cephalo.operator.netpol import ENV_FLAG, render_network_policy
from cephalo.operator.render import render as render_job

TEAMS = ["team-a", "team-b"]
VALUES: dict[str, Any] = {"networkPolicy": {"enabled": True}, "watchNamespaces": TEAMS}
MASTER_PORT, TRAINER_METRICS, OPERATOR_METRICS, HEALTH = 29500, 9400, 8080, 8081
NCCL_PORT = 43127  # an ephemeral port NCCL's socket transport might use between ranks


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        present, value = expr["key"] in labels, labels.get(expr["key"])
        op = expr["operator"]
        if (op == "In" and value not in expr["values"]) or \
                (op == "NotIn" and present and value in expr["values"]) or \
                (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def _ns_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}  # set on every namespace since 1.22


def _peer_matches(peer: dict[str, Any], policy_ns: str, source: Pod) -> bool:
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], _ns_labels(source.namespace)):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], source.labels)


def reachable(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    selecting = [p for p in policies if p["metadata"]["namespace"] == target.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], target.labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            ports = rule.get("ports")
            if (not peers or any(_peer_matches(peer, target.namespace, source)
                                 for peer in peers)) and \
                    (not ports or any(p.get("port") == port for p in ports)):
                return True
    return False


def _rank_pods(name: str, namespace: str) -> list[Pod]:
    job = parse_job(job_body(name, namespace=namespace,
                             uid="00000000-0000-4000-8000-0000000000aa"))
    plan = Plan.model_validate({
        "global_batch_size": 64, "world_size": 2, "predicted_step_seconds": 1.0,
        "predicted_samples_per_second": 64.0,
        "ranks": [{"rank": i, "gpu": "L4", "pool": "NVIDIA-L4", "batch_size": 32,
                   "micro_batch_size": 8, "num_micro_batches": 4, "shard_ratio": 0.5}
                  for i in range(2)]})
    return [Pod(namespace, p["metadata"]["labels"]) for p in render_job(job, plan)[2:]]


def _job_policy(name: str, namespace: str) -> dict[str, Any]:
    job = parse_job(job_body(name, namespace=namespace,
                             uid="00000000-0000-4000-8000-0000000000aa"))
    return render_network_policy(job)


def test_network_policies_fence_operator_and_ranks() -> None:
    objects = render(VALUES)
    policies = [strip(p) for p in by_kind(objects, "NetworkPolicy")]
    assert sorted(p["metadata"]["namespace"] for p in policies) == sorted(
        [RELEASE_NAMESPACE, *TEAMS])
    policies += [_job_policy("gpt", "team-a"), _job_policy("bert", "team-a")]
    for policy in policies:
        for version in ("1.27.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(policy, version, strict=True)
    deployment = one(objects, "Deployment")
    operator = Pod(RELEASE_NAMESPACE, deployment["spec"]["template"]["metadata"]["labels"])
    prometheus = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    stranger = Pod("team-a", {"app": "notebook"})
    gpt0, gpt1 = _rank_pods("gpt", "team-a")
    bert0, _ = _rank_pods("bert", "team-a")
    other_team = _rank_pods("gpt", "team-b")[0]

    # The operator: /metrics from monitoring only.
    assert reachable(policies, prometheus, operator, OPERATOR_METRICS)
    assert not reachable(policies, prometheus, operator, HEALTH)
    assert not reachable(policies, stranger, operator, OPERATOR_METRICS)
    assert not reachable(policies, gpt0, operator, OPERATOR_METRICS)
    # Ranks of one job reach each other on every port (rendezvous, NCCL's own ports).
    for port in (MASTER_PORT, NCCL_PORT, TRAINER_METRICS):
        assert reachable(policies, gpt1, gpt0, port)
    # Another job's ranks, in the same namespace or another, and other pods: nothing.
    for source in (bert0, other_team, stranger):
        for port in (MASTER_PORT, NCCL_PORT, TRAINER_METRICS):
            assert not reachable(policies, source, gpt0, port), (source, port)
    # Trainer /metrics: monitoring and the operator (progress), and only that port.
    for source in (prometheus, operator):
        assert reachable(policies, source, gpt0, TRAINER_METRICS)
        assert not reachable(policies, source, gpt0, MASTER_PORT)


def test_network_policies_follow_values() -> None:
    assert not by_kind(render(), "NetworkPolicy")
    assert container_env(one(render(), "Deployment"))[ENV_FLAG] == "false"
    objects = render({**VALUES, "networkPolicy": {
        "enabled": True, "monitoringNamespaces": ["observability", "kps"],
        "monitoringPodSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        "metrics": {"port": 9090}, "operator": {"trainerMetricsPort": 9500}})
    assert container_env(one(objects, "Deployment"))[ENV_FLAG] == "true"
    policies = [strip(p) for p in by_kind(objects, "NetworkPolicy")]
    operator_policy = next(p for p in policies if p["metadata"]["namespace"] == RELEASE_NAMESPACE)
    assert operator_policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9090}]
    trainers = next(p for p in policies if p["metadata"]["namespace"] == "team-a")
    assert trainers["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9500}]
    assert trainers["spec"]["ingress"][0]["from"][0] == {
        "namespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In",
            "values": ["observability", "kps"]}]},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    with pytest.raises(helm.HelmRenderError, match=r"networkPolicy\.enabled needs watchNamespaces"):
        render({"networkPolicy": {"enabled": True}})


def test_namespaced_rbac_grants_nothing_outside_the_watched_namespaces() -> None:
    """Multi-tenant: Roles only in the teams' namespaces (and, in the operator's own, its
    leader election's Lease and the network probe's cache of ConfigMaps alone); the
    ClusterRole reads node labels, CRDs and namespaces, and can write nothing."""
    objects = render({"rbac": {"scope": "namespaced"}, "watchNamespaces": TEAMS})
    own = {"-leader-election": {("coordination.k8s.io", "leases")},
           "-network-profiles": {("", "configmaps")}}  # the operator's namespace's Roles
    mine = [r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith(tuple(own))]
    roles = [r for r in by_kind(objects, "Role") if r not in mine]
    assert len(mine) == len(own)
    for role in mine:
        assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
        suffix = next(s for s in own if role["metadata"]["name"].endswith(s))
        assert {(p.group, p.resource) for p in permissions(role)} == own[suffix]
    assert sorted(r["metadata"]["namespace"] for r in roles) == TEAMS
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objects, "RoleBinding")
                  if not b["metadata"]["name"].endswith(tuple(own))) == TEAMS
    cluster = permissions(one(objects, "ClusterRole"))
    assert {p.verb for p in cluster} <= {"get", "list", "watch"}
    assert {p.resource for p in cluster} == {"nodes", "customresourcedefinitions", "namespaces"}
    for role in roles:
        granted = permissions(role)
        assert {p.resource for p in granted} >= {"pods", "podgroups", "networkpolicies"}
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith(("--namespace", "--all-namespaces"))] == [
        f"--namespace={ns}" for ns in TEAMS]
