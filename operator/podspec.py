"""Merge a job's `spec.podTemplate` into a rendered rank or profiler pod (pure).

The operator's fields win where they must: its labels and annotations, the trainer's
environment contract, its volumes and mounts, the GPU resource, the nodeSelector and the
security context. Collisions that would silently lose the team's setting (an env var named
like a contract variable, a volume named like one of the operator's) are refused when the
job is parsed (cephalo.api.podtemplate); what is left here is additive.
"""

from __future__ import annotations

import copy
from typing import Any

from cephalo.api.podtemplate import PodTemplate


def _wire(items: list[Any] | None) -> list[dict[str, Any]]:
    return [i.model_dump(by_alias=True, exclude_none=True, mode="json")
            if hasattr(i, "model_dump") else copy.deepcopy(i) for i in items or []]


def apply_pod_template(pod: dict[str, Any], template: PodTemplate | None) -> dict[str, Any]:
    """`pod` with the template's additions (a new dict; `pod` itself is left untouched)."""
    if template is None:
        return pod
    pod = copy.deepcopy(pod)
    meta, spec = pod["metadata"], pod["spec"]
    (container,) = spec["containers"]
    if template.labels:
        meta["labels"] = {**template.labels, **meta.get("labels", {})}
    if template.annotations:
        meta["annotations"] = {**template.annotations, **meta.get("annotations", {})}
    if template.env:
        container["env"] = [*container.get("env", []), *_wire(template.env)]
    if template.env_from:
        # Explicit env entries take precedence over envFrom in Kubernetes, so a Secret key
        # that happens to be named RANK cannot override the contract.
        container["envFrom"] = _wire(template.env_from)
    if template.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *_wire(template.volumes)]
    if template.volume_mounts:
        container["volumeMounts"] = [*container.get("volumeMounts", []),
                                     *_wire(template.volume_mounts)]
    if template.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *_wire(template.tolerations)]
    if template.image_pull_secrets:
        spec["imagePullSecrets"] = _wire(template.image_pull_secrets)
    if template.affinity:
        spec["affinity"] = copy.deepcopy(template.affinity)
    if template.priority_class_name:
        spec["priorityClassName"] = template.priority_class_name
    if template.service_account_name:
        # Opt-in identity for cloud workload identity (IRSA, GKE); the Kubernetes API token
        # stays unmounted (automountServiceAccountToken: false): trainers never call the API.
        spec["serviceAccountName"] = template.service_account_name
    if template.resources:
        resources = container.setdefault("resources", {})
        for kind in ("requests", "limits"):
            extra = getattr(template.resources, kind)
            if extra:
                # The GPU count is the plan's (one per rank): the operator's values win.
                resources[kind] = {**extra, **resources.get(kind, {})}
    return pod
