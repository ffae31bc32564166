"""Real Helm against the real API server: `helm install` of charts/cephalo-operator creates
the CRD (Established: structural, CEL rules compiled within their cost budget), the RBAC
objects, the ServiceAccount, Deployment and Service; `kubectl explain` reads the schema;
and a real token of the chart's ServiceAccount is authorized by the chart's RBAC, checked by
the server's own authorizer."""

from __future__ import annotations

import subprocess
from typing import Any

import yaml

from .cluster import CHART, OPERATOR_NAMESPACE, RELEASE, Cluster, run_tool
from .operator_auth import operator_rest, service_account_name


def test_helm_install_creates_every_object(cluster: Cluster,
                                           installed_chart: subprocess.CompletedProcess[str],
                                           crd: dict[str, Any]) -> None:
    assert "STATUS: deployed" in installed_chart.stdout, installed_chart.stdout
    # The server stored the chart's CRD as written (nothing pruned or refused).
    ours = yaml.safe_load((CHART / "crds" / "cephalojob.yaml").read_text())
    stored = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert not _differences(stored, ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    assert crd["status"]["acceptedNames"]["shortNames"] == ["cjob"]
    manifest = run_tool(cluster, "helm", "get", "manifest", RELEASE, "-n", OPERATOR_NAMESPACE)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(manifest.stdout) if d}
    assert {k for k, _ in kinds} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                     "Deployment", "Service"}, kinds
    for kind, name in kinds:  # every object is in the API server, as Helm rendered it
        resource = {"ServiceAccount": f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts",
                    "Service": f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/services",
                    "ConfigMap": f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/configmaps",
                    "Deployment": f"/apis/apps/v1/namespaces/{OPERATOR_NAMESPACE}/deployments",
                    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                    "ClusterRoleBinding":
                        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"}.get(kind)
        if resource is not None:
            assert cluster.rest.get(f"{resource}/{name}").ok, f"{kind} {name} missing"


def test_kubectl_explain_reads_the_schema(cluster: Cluster, crd: dict[str, Any]) -> None:
    spec = run_tool(cluster, "kubectl", "explain", "cephalojob.spec").stdout
    for field in ("globalBatchSize", "model", "podTemplate", "checkpoint", "gpuPools"):
        assert field in spec, spec
    resources = run_tool(cluster, "kubectl", "explain",
                         "cephalojob.spec.podTemplate.resources.requests").stdout
    assert "Guaranteed resources" in resources, resources


def test_kubectl_short_name_resolves_to_cephalojobs(cluster: Cluster,
                                                   crd: dict[str, Any]) -> None:
    # `cj` is CronJob's: a real server gives it to the built-in group (the README walk of
    # session 9 saw `kubectl get cj` list CronJobs). Ours is `cjob`.
    ours = run_tool(cluster, "kubectl", "api-resources", "--api-group", "cephalo.dev").stdout
    assert "cjob" in ours.split(), ours
    cron = run_tool(cluster, "kubectl", "get", "cj", "-A", "-o", "name")
    assert "could also match" not in cron.stderr, cron.stderr
    run_tool(cluster, "kubectl", "get", "cjob", "-A")  # resolves (run_tool checks the exit)


def test_chart_service_account_token_gets_what_the_chart_grants_and_no_more(
        cluster: Cluster, installed_chart: subprocess.CompletedProcess[str]) -> None:
    """A real token (TokenRequest) of the chart's ServiceAccount, authorized by the real RBAC
    authorizer: every rule of the chart's ClusterRole is allowed, secrets are not. (Whether
    the grants suffice is the operator test's verdict: it runs a job with this token.)"""
    manifest = run_tool(cluster, "helm", "get", "manifest", RELEASE, "-n", OPERATOR_NAMESPACE)
    (role,) = [d for d in yaml.safe_load_all(manifest.stdout) if d and d["kind"] == "ClusterRole"]
    rest = operator_rest(cluster)
    denied = []
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                name, _, sub = resource.partition("/")
                for verb in rule["verbs"]:
                    review = rest.create(
                        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                        {"spec": {"resourceAttributes": {"group": group, "resource": name,
                                                         "subresource": sub, "verb": verb}}})
                    if not review["status"]["allowed"]:
                        denied.append(f"{verb} {group or 'core'}/{resource}")
    assert not denied, f"{service_account_name(cluster)} is denied: {denied}"
    secrets = rest.request("GET", "/api/v1/namespaces/default/secrets")
    assert secrets.status == 403, secrets.message


def _differences(server: Any, chart: Any, path: str = "") -> list[str]:
    """Where the stored schema differs from the chart's (numbers compared by value)."""
    if isinstance(server, dict) and isinstance(chart, dict):
        return [d for k in sorted(set(server) | set(chart)) for d in (
            [f"{path}.{k}: only in {'the server' if k in server else 'the chart'}"]
            if (k in server) != (k in chart) else _differences(server[k], chart[k], f"{path}.{k}"))]
    if isinstance(server, list) and isinstance(chart, list) and len(server) == len(chart):
        return [d for i, (a, b) in enumerate(zip(server, chart, strict=True))
                for d in _differences(a, b, f"{path}[{i}]")]
    return [] if server == chart else [f"{path}: {server!r} != {chart!r}"]


def test_helm_template_renders_offline_as_the_chart_readme_says(cluster: Cluster) -> None:
    """The chart README's `helm template` line (no cluster needed) renders every object;
    without --kube-version real Helm assumes v1.20 and says the chart requires more, which
    is why the README gives it."""
    readme = (CHART / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("helm template "))
    argv = line.split(" > ")[0].split()
    assert argv[:4] == ["helm", "template", "cephalo", "charts/cephalo-operator"], line
    rendered = run_tool(cluster, "helm", "template", RELEASE, str(CHART), *argv[4:])
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered.stdout) if d}
    assert {"ServiceAccount", "ClusterRole", "Deployment", "Service"} <= kinds, kinds
    bare = run_tool(cluster, "helm", "template", RELEASE, str(CHART), check=False)
    assert bare.returncode != 0 and "kubeVersion" in bare.stderr, bare.stderr
