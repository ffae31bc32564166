"""Per-job NetworkPolicy: only a job's own ranks reach its ranks (opt-in, chart value
`networkPolicy.enabled` → CEPHALO_JOB_NETWORK_POLICIES=true).

A static policy cannot say "pods with the same value of cephalo.dev/job", so the chart's
policies cover what is the same for every job (trainer /metrics from monitoring and from the
operator) and the operator adds, per job, the rule that lets the job's ranks reach each
other. All ports: the rendezvous port is only the start; NCCL and gloo then connect on
ports of their own. NetworkPolicies are additive: a rank pod selected by these accepts the
union of their rules and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from cephalo.api import CephaloJob
from cephalo.operator.kube import not_owned, owned_by
from cephalo.operator.render import LABEL_JOB, LABEL_ROLE, job_name, owner_reference

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

ENV_FLAG = "CEPHALO_JOB_NETWORK_POLICIES"  # read by OperatorConfig (job_network_policies)


def network_policies_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/networking.k8s.io/v1/namespaces/{quote(namespace)}/networkpolicies"
    return path + (f"/{quote(name)}" if name else "")


def network_policy_name(job: CephaloJob) -> str:
    return f"{job_name(job)}-ranks"


def render_network_policy(job: CephaloJob) -> dict[str, Any]:
    """Ingress to the job's rank pods from the job's rank pods, on every port (pure)."""
    ranks = {LABEL_JOB: job_name(job), LABEL_ROLE: "trainer"}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": network_policy_name(job), "namespace": job.metadata.namespace,
                     "labels": {LABEL_JOB: job_name(job), LABEL_ROLE: "network-policy"},
                     "ownerReferences": [owner_reference(job)]},
        "spec": {"podSelector": {"matchLabels": ranks}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": ranks}}]}]},
    }


async def ensure_network_policy(ctx: JobContext) -> None:
    """Create the job's policy if absent (it never changes: names and labels are fixed)."""
    if not ctx.config.job_network_policies:
        return
    path = network_policies_path(ctx.namespace)
    created, _ = await ctx.kube.create(path, render_network_policy(ctx.job))
    if not owned_by(created, ctx.uid):  # an older job's namesake: delete it, wait for it
        await ctx.kube.delete(f"{path}/{created['metadata']['name']}",
                              created["metadata"]["uid"])
        raise not_owned(created)


__all__ = ["ensure_network_policy", "render_network_policy"]
