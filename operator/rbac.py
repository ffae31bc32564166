"""The Kubernetes permissions the operator uses (the Helm chart's ClusterRole must grant them).

The end-to-end tests record every request the real operator process makes and fail if one
is not covered here, so this list stays the truth; a chart test can compare against it.
"""

from __future__ import annotations

from cephalo.api import API_GROUP, PLURAL

# (apiGroup, resource, verbs)
RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (API_GROUP, PLURAL, ("get", "list", "watch", "patch", "delete")),
    (API_GROUP, f"{PLURAL}/status", ("get", "patch")),
    ("", "pods", ("get", "list", "watch", "create", "delete")),
    # list: the network measurements cached in the operator's namespace (netprobe.py)
    ("", "configmaps", ("get", "list", "create", "patch", "delete")),
    ("", "services", ("get", "create", "delete")),  # delete: an older job's namesake
    ("", "events", ("create", "patch")),
    ("", "nodes", ("get", "list", "watch")),
    # Gang scheduling: the PodGroup of Volcano or of scheduler-plugins coscheduling
    ("scheduling.volcano.sh", "podgroups", ("get", "list", "create", "delete")),
    ("scheduling.x-k8s.io", "podgroups", ("get", "list", "create", "delete")),
    # Opt-in per-job NetworkPolicy (only the job's ranks reach its ranks; cephalo.operator.netpol)
    ("networking.k8s.io", "networkpolicies", ("get", "create", "delete")),
    # kopf discovers custom resources and namespaces (read-only)
    ("apiextensions.k8s.io", "customresourcedefinitions", ("get", "list", "watch")),
    ("", "namespaces", ("get", "list", "watch")),
)


def allowed(verb: str, group: str, resource: str) -> bool:
    return any(g == group and r == resource and verb in verbs for g, r, verbs in RULES)
