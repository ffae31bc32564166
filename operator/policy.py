"""What a CephaloJob may ask of the pods the operator creates for it (issue 39, item 9;
issue 46, item 7); pure.

Whoever may create a CephaloJob in a namespace gets pods there that the operator creates
with its own rights: without a policy a Role granting only the CR would grant any volume
(hostPath: the node's files), any service account of the namespace (its cloud identity),
any image, any PriorityClass (preempting other teams) and any toleration (nodes kept for
others). The chart's jobPolicy values say what is allowed; its ValidatingAdmissionPolicy
refuses the rest at `kubectl apply`, and the operator checks the same values (given as
environment variables) again before it creates a pod, for a cluster without that policy
(older than 1.30, or admissionPolicy.enabled=false) or a job admitted before it.

Volume types and the service account are refused unless allowed; images, priority classes
and tolerations are free unless their list is set (an empty list: no restriction, the
behaviour before these lists existed, so existing jobs keep running).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cephalo.api.job import CephaloJobSpec
from cephalo.api.podtemplate import PodTemplate, Toleration
from cephalo.api.podtemplate_rules import KEY

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
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# An allowed image prefix starts with a registry host as container runtimes read one (a
# first component with a dot or a port, or localhost): "myregistry/x" would be pulled from
# Docker Hub, so a prefix "myregistry" would not say what an admin meant. Then optionally
# repository path components. The chart's values.schema.json has the same pattern.
IMAGE_PREFIX_PATTERN = (r"^((localhost|[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+)(:[0-9]{1,5})?"
                        r"|[A-Za-z0-9-]+:[0-9]{1,5})(/[a-z0-9._-]+)*/?$")
IMAGE_PREFIX = re.compile(IMAGE_PREFIX_PATTERN)
# DNS subdomain: a PriorityClass (or ServiceAccount) name.
NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
REASON = "PolicyDenied"  # the Failed condition's reason and the Event's


@dataclass(frozen=True)
class AllowedToleration:
    """A toleration key a job may use; with `effect`, only a toleration of that effect (a
    toleration without an effect tolerates every effect of the key, so it is refused)."""

    key: str
    effect: str | None = None

    def __str__(self) -> str:  # as the chart passes it: key or key:effect
        return f"{self.key}:{self.effect}" if self.effect else self.key


@dataclass(frozen=True)
class JobPolicy:
    volume_types: frozenset[str] = frozenset(RESTRICTED_VOLUME_TYPES)
    service_account_allowed: bool = False
    service_account_names: frozenset[str] = frozenset()  # allowed: empty means any
    image_prefixes: tuple[str, ...] = ()  # empty means any image
    priority_class_names: frozenset[str] = frozenset()  # empty means any
    tolerations: frozenset[AllowedToleration] = frozenset()  # empty means any


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


def parse_image_prefixes(raw: str) -> tuple[str, ...]:
    """CEPHALO_ALLOWED_IMAGE_PREFIXES: registry hosts or repository paths, a trailing slash
    dropped (the match is by whole path components, see `image_allowed`)."""
    prefixes = split_names(raw)
    if bad := [p for p in prefixes if not IMAGE_PREFIX.match(p)]:
        raise ValueError(f"{', '.join(bad)}: not a registry prefix; give a registry host "
                         "(with a dot or a port, or localhost) and optionally a repository "
                         "path, e.g. registry.example.com/ml")
    return tuple(p.rstrip("/") for p in prefixes)


def parse_names(raw: str) -> frozenset[str]:
    """CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES: Kubernetes object names."""
    names = split_names(raw)
    if bad := [n for n in names if not NAME.match(n)]:
        raise ValueError(f"{', '.join(bad)}: not a Kubernetes object name (lower-case "
                         "letters, digits, '-' and '.')")
    return frozenset(names)


def parse_tolerations(raw: str) -> frozenset[AllowedToleration]:
    """CEPHALO_ALLOWED_TOLERATIONS: `key` (every effect) or `key:effect`, comma-separated
    (a taint key has neither ',' nor ':')."""
    allowed = set()
    for item in split_names(raw):
        key, _, effect = (part.strip() for part in item.partition(":"))
        if not KEY.match(key) or (effect and effect not in TAINT_EFFECTS):
            raise ValueError(f"{item}: not a toleration key or key:effect (a taint key such "
                             f"as dedicated or example.com/pool; effects: "
                             f"{', '.join(TAINT_EFFECTS)})")
        allowed.add(AllowedToleration(key, effect or None))
    return frozenset(allowed)


def volume_types(volume: dict[str, object]) -> list[str]:
    """A volume's type keys: every key but its name. None at all is an emptyDir (the API
    server's default)."""
    return [k for k in volume if k != "name"] or ["emptyDir"]


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `image` (as written) lies under one of `prefixes`, by whole path components:
    a host admits its repositories (registry.example.com admits registry.example.com/x, not
    registry.example.com.evil.io/x nor another port); a repository path also admits its
    tags and digests (…/trainer admits …/trainer:1 and …/trainer@sha256:…, not
    …/trainer-evil). No prefixes: every image."""
    if not prefixes:
        return True
    return any(image.startswith(p + "/")
               or ("/" in p and (image == p or image.startswith((p + ":", p + "@"))))
               for p in prefixes)


def toleration_allowed(toleration: Toleration, allowed: frozenset[AllowedToleration]) -> bool:
    """Whether one of the job's tolerations is on the list (no list: every toleration). One
    without a key tolerates every taint: no entry matches it, so any list refuses it."""
    if not allowed:
        return True
    return any(
        a.key == toleration.key and (a.effect is None or a.effect == toleration.effect)
        for a in allowed)


def _toleration(toleration: Toleration) -> str:
    if not toleration.key:
        return "one without a key (it tolerates every taint)"
    return f"key {toleration.key} " + (f"effect {toleration.effect}" if toleration.effect
                                       else "with every effect")


def _images(spec: CephaloJobSpec) -> list[tuple[str, str]]:
    """(where, image) of every image the job names: spec.image and image volumes."""
    found = [("spec.image", spec.image)] if spec.image else []
    for volume in (spec.pod_template.volumes or []) if spec.pod_template else []:
        source = volume.get("image")
        if isinstance(source, dict) and isinstance(source.get("reference"), str):
            found.append((f"podTemplate.volumes: volume {volume.get('name')} image",
                          source["reference"]))
    return found


def _priority_classes(spec: CephaloJobSpec) -> list[tuple[str, str]]:
    """(field, name) of every PriorityClass the job names (its pods, its PodGroup)."""
    found = []
    if spec.pod_template and spec.pod_template.priority_class_name:
        found.append(("podTemplate.priorityClassName", spec.pod_template.priority_class_name))
    if spec.scheduling_policy and spec.scheduling_policy.priority_class_name:
        found.append(("schedulingPolicy.priorityClassName",
                      spec.scheduling_policy.priority_class_name))
    return found


def _template_refusals(template: PodTemplate, policy: JobPolicy) -> list[str]:
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
    if refused := [t for t in template.tolerations or []
                   if not toleration_allowed(t, policy.tolerations)]:
        problems.append(
            f"podTemplate.tolerations: {', '.join(_toleration(t) for t in refused)}: not a "
            "toleration this cluster's Cephalo policy allows (allowed: "
            f"{', '.join(sorted(str(a) for a in policy.tolerations))}); use one of those, or "
            "ask a cluster admin to add it to the chart value jobPolicy.allowedTolerations")
    return problems


def refusal(spec: CephaloJobSpec, policy: JobPolicy) -> str | None:
    """One line naming what of the job `spec` the policy forbids and how to get it allowed,
    or None when the job may run. The wording is the admission policy's
    (charts/cephalo-operator/templates/jobpolicy.yaml)."""
    problems = _template_refusals(spec.pod_template, policy) if spec.pod_template else []
    if images := [f"{where} {image}" for where, image in _images(spec)
                  if not image_allowed(image, policy.image_prefixes)]:
        problems.append(
            f"{', '.join(images)}: not from a registry this cluster's Cephalo policy allows "
            f"(allowed: {', '.join(policy.image_prefixes)}); use an image from one of those, "
            "or ask a cluster admin to add its registry to the chart value "
            "jobPolicy.allowedImagePrefixes")
    if classes := [f"{field} {name}" for field, name in _priority_classes(spec)
                   if policy.priority_class_names and name not in policy.priority_class_names]:
        problems.append(
            f"{', '.join(classes)}: not a PriorityClass this cluster's Cephalo policy allows "
            f"(allowed: {', '.join(sorted(policy.priority_class_names))}); use one of those, "
            "or ask a cluster admin to add it to the chart value "
            "jobPolicy.allowedPriorityClassNames")
    return "; ".join(problems) or None
