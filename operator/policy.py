"""What a CephaloJob may ask of the pods the operator creates for it (issue 39, item 9); pure.

Whoever may create a CephaloJob in a namespace gets pods there that the operator creates
with its own rights: without a policy a Role granting only the CR would grant any volume
(hostPath: the node's files) and any service account of the namespace (its cloud
identity). The chart's jobPolicy values say what is allowed; its ValidatingAdmissionPolicy
refuses the rest at `kubectl apply`, and the operator checks the same values (given as
environment variables) again before it creates a pod, for a cluster without that policy
(older than 1.30, or admissionPolicy.enabled=false) or a job admitted before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.api.podtemplate import PodTemplate

# The volume types Pod Security `restricted` allows: the default.
RESTRICTED_VOLUME_TYPES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret")
# Every volume type of core/v1 Volume (the chart's values.schema.json lists the same).
VOLUME_TYPES = frozenset({
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi",
    "downwardAPI", "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk",
    "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim",
    "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd", "scaleIO",
    "secret", "storageos", "vsphereVolume"})
REASON = "PolicyDenied"  # the Failed condition's reason and the Event's


@dataclass(frozen=True)
class JobPolicy:
    volume_types: frozenset[str] = frozenset(RESTRICTED_VOLUME_TYPES)
    service_account_allowed: bool = False
    service_account_names: frozenset[str] = frozenset()  # allowed: empty means any


def split_names(raw: str) -> list[str]:
    """A comma-separated list as the chart renders it ("" is none)."""
    return [n.strip() for n in raw.split(",") if n.strip()]


def parse_volume_types(raw: str) -> frozenset[str]:
    """CEPHALO_ALLOWED_VOLUME_TYPES; an unknown name (a typo such as hostpath) is refused at
    start-up rather than silently allowing nothing of that kind."""
    names = split_names(raw)
    if unknown := sorted(set(names) - VOLUME_TYPES):
        raise ValueError(f"{', '.join(unknown)}: not a Kubernetes volume type (known: "
                         f"{', '.join(sorted(VOLUME_TYPES))})")
    return frozenset(names)


def volume_types(volume: dict[str, object]) -> list[str]:
    """A volume's type keys: every key but its name. None at all is an emptyDir (the API
    server's default)."""
    return [k for k in volume if k != "name"] or ["emptyDir"]


def refusal(template: PodTemplate | None, policy: JobPolicy) -> str | None:
    """One line naming what of `template` the policy forbids and how to get it allowed, or
    None when the job may run."""
    if template is None:
        return None
    problems = []
    allowed = ", ".join(sorted(policy.volume_types)) or "none"
    for volume in template.volumes or []:
        if bad := [t for t in volume_types(volume) if t not in policy.volume_types]:
            problems.append(
                f"podTemplate.volumes: volume {volume.get('name')} is {'+'.join(bad)}, a volume "
                f"type this cluster's Cephalo policy does not allow (allowed: {allowed}); use "
                "one of those, or ask a cluster admin to add the type to the chart value "
                "jobPolicy.allowedVolumeTypes")
    account = template.service_account_name
    if account is not None and not policy.service_account_allowed:
        problems.append(
            f"podTemplate.serviceAccountName {account} is not allowed: this cluster's Cephalo "
            "policy lets no job choose a service account (its pods would carry that "
            "account's identity); remove it, or ask a cluster admin to set the chart value "
            "jobPolicy.serviceAccountName.allowed (and list the name in "
            "jobPolicy.serviceAccountName.names)")
    elif account is not None and policy.service_account_names and \
            account not in policy.service_account_names:
        problems.append(
            f"podTemplate.serviceAccountName {account} is not one this cluster's Cephalo "
            f"policy allows ({', '.join(sorted(policy.service_account_names))}): its pods "
            "would carry that account's identity; use one of those, or ask a cluster admin "
            "to add it to the chart value jobPolicy.serviceAccountName.names")
    return "; ".join(problems) or None
