"""The operator's identity from the installed chart: its Deployment's ServiceAccount and a
real token for it (the TokenRequest API), so requests are authorized by the chart's RBAC."""

from __future__ import annotations

from pathlib import Path

from .cluster import OPERATOR_NAMESPACE, Cluster
from .controlplane import ISSUER
from .rest import Rest

TOKEN_SECONDS = 3600


def service_account_name(cluster: Cluster | None = None) -> str:
    if cluster is None:
        return f"{OPERATOR_NAMESPACE}/(the chart's operator ServiceAccount)"
    deployments = cluster.rest.must(
        "GET", f"/apis/apps/v1/namespaces/{OPERATOR_NAMESPACE}/deployments")["items"]
    (deployment,) = deployments
    return str(deployment["spec"]["template"]["spec"]["serviceAccountName"])


def operator_token(cluster: Cluster) -> str:
    name = service_account_name(cluster)
    reply = cluster.rest.create(
        f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{name}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"audiences": [ISSUER], "expirationSeconds": TOKEN_SECONDS}})
    return str(reply["status"]["token"])


def operator_rest(cluster: Cluster) -> Rest:
    return cluster.rest.as_token(operator_token(cluster))


def operator_kubeconfig(cluster: Cluster) -> Path:
    return cluster.plane.token_kubeconfig("operator.kubeconfig", operator_token(cluster))
