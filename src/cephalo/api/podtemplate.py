"""`spec.podTemplate`: what a team adds to every rank and profiler pod (storage credentials,
loggers, node placement, priority, CPU/memory), merged by the operator with its own fields.

Kubernetes sub-objects the operator only passes through (volumes, affinity, an env var's
valueFrom) are plain dicts: the CRD keeps them with `x-kubernetes-preserve-unknown-fields`
and the API server validates them when it creates the pod. What the operator must own is
refused here, at admission, with a message saying why: the trainer's environment contract,
the volumes and paths it mounts, its labels and annotations, the GPU resource.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from cephalo.api.trainer_env import OPERATOR_SET

# Environment variables the operator sets on rank and profiler pods (DESIGN.md's trainer
# contract, plus HOME, which must point at the writable /tmp under a read-only root).
CONTRACT_ENV = frozenset({*OPERATOR_SET, "HOME"})
# Volumes the operator mounts, by name and path (the token-file volume's path is the job's
# data.tokenFile.mountPath; the operator checks that one when it renders).
OPERATOR_VOLUMES = frozenset({"config", "tmp", "dshm", "checkpoints", "dataset"})
OPERATOR_PATHS = ("/etc/cephalo", "/tmp", "/dev/shm", "/checkpoints")
RESERVED_PREFIX = "cephalo.dev/"
# CPU and memory are the team's to size; accelerators come from the plan (one per rank).
ALLOWED_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[KMGTPE]i|[numkMGTPE])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# Kubernetes label/annotation keys ([DNS-subdomain prefix/]name) and label values: the API
# server would refuse the pods much later, one reconcile at a time.
_NAME_63 = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME_63}$")
_LABEL_VALUE = re.compile(rf"^{_NAME_63}?$")


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class EnvVar(_Model):
    """An environment variable: a value, or `valueFrom` (a secretKeyRef, configMapKeyRef, …)."""

    name: str = Field(min_length=1, description="Variable name (not one the operator sets).")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(default=None, description=(
        "Kubernetes EnvVarSource, e.g. {secretKeyRef: {name: s3, key: secret}}."))

    @model_validator(mode="after")
    def _checked(self) -> EnvVar:
        if not _ENV_NAME.match(self.name):
            raise ValueError(f"env name {self.name!r} is not a valid environment variable name")
        if self.name in CONTRACT_ENV:
            raise ValueError(
                f"env {self.name} is set by the operator (the trainer's environment contract); "
                "remove it from podTemplate.env")
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: give `value` or `valueFrom`, not both")
        return self


# Three reference types rather than one shared class: each is inlined into the CRD, and one
# class inlined in several places would come out as YAML anchors in the generated file.
class SecretRef(_Model):
    """A Secret in the job's namespace."""

    name: str = Field(min_length=1, description="Secret name.")
    optional: bool | None = Field(default=None, description="Start even if it is missing.")


class ConfigMapRef(_Model):
    """A ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, description="ConfigMap name.")
    optional: bool | None = Field(default=None, description="Start even if it is missing.")


class PullSecret(_Model):
    """A docker-registry Secret in the job's namespace."""

    name: str = Field(min_length=1, description="Secret name.")


class EnvFromSource(_Model):
    """All keys of a Secret or ConfigMap as environment variables (e.g. AWS credentials)."""

    prefix: str | None = Field(default=None, description="Prepended to every key.")
    secret_ref: SecretRef | None = Field(default=None, description="Secret to read.")
    config_map_ref: ConfigMapRef | None = Field(default=None, description="ConfigMap to read.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("envFrom entries need exactly one of secretRef or configMapRef")
        return self


class VolumeMount(_Model):
    """Where one of podTemplate.volumes appears in the trainer container."""

    name: str = Field(min_length=1, description="A volume from podTemplate.volumes.")
    mount_path: str = Field(min_length=1, description="Absolute path in the container.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    sub_path: str | None = Field(default=None, description="Mount only this path of the volume.")


class Toleration(_Model):
    """Lets rank and profiler pods onto nodes with a matching taint."""

    key: str | None = Field(default=None, description="Taint key (none: every taint).")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description=(
        "Equal (default) compares the value; Exists matches any value."))
    value: str | None = Field(default=None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate (none: all).")
    toleration_seconds: int | None = Field(default=None, ge=0, description=(
        "NoExecute only: how long the pod stays after the taint appears."))


class Resources(_Model):
    """CPU, memory and ephemeral-storage requests/limits of the trainer container (values are
    Kubernetes quantities: 8, "500m", "64Gi"). GPUs come from the plan, one per rank."""

    requests: dict[str, Any] | None = Field(default=None, description=(
        "Guaranteed resources, e.g. {cpu: 8, memory: 64Gi}."))
    limits: dict[str, Any] | None = Field(default=None, description=(
        "Caps, e.g. {memory: 64Gi} (the container is killed above it)."))

    @model_validator(mode="after")
    def _quantities(self) -> Resources:
        for kind in ("requests", "limits"):
            for name, value in (getattr(self, kind) or {}).items():
                if name not in ALLOWED_RESOURCES:
                    raise ValueError(
                        f"resources.{kind}.{name}: only {', '.join(sorted(ALLOWED_RESOURCES))} "
                        "may be set here; GPUs come from the plan (one per rank)")
                if isinstance(value, bool) or not isinstance(value, int | float | str) or \
                        not _QUANTITY.match(str(value)):
                    raise ValueError(f"resources.{kind}.{name}: {value!r} is not a Kubernetes "
                                     "quantity (e.g. 8, \"500m\", \"64Gi\")")
        return self


class PodTemplate(_Model):
    """Additions to every rank and profiler pod; the operator's own fields win (GPU resource,
    nodeSelector, trainer environment, security context, its volumes and labels)."""

    labels: dict[str, str] | None = Field(default=None, description=(
        "Extra pod labels (not cephalo.dev/*), e.g. kueue.x-k8s.io/queue-name."))
    annotations: dict[str, str] | None = Field(default=None, description=(
        "Extra pod annotations (not cephalo.dev/*)."))
    env: list[EnvVar] | None = Field(default=None, description=(
        "Extra environment variables of the trainer container."))
    env_from: list[EnvFromSource] | None = Field(default=None, description=(
        "Secrets/ConfigMaps whose keys become environment variables (storage credentials)."))
    volumes: list[dict[str, Any]] | None = Field(default=None, description=(
        "Extra Kubernetes volumes (each with a name); mount them with volumeMounts."))
    volume_mounts: list[VolumeMount] | None = Field(default=None, description=(
        "Mounts of podTemplate.volumes in the trainer container."))
    image_pull_secrets: list[PullSecret] | None = Field(default=None, description=(
        "Secrets for pulling the trainer image from a private registry."))
    tolerations: list[Toleration] | None = Field(default=None, description=(
        "Extra tolerations (the GPU taint nvidia.com/gpu is always tolerated)."))
    affinity: dict[str, Any] | None = Field(default=None, description=(
        "Kubernetes affinity; the GPU product's nodeSelector still applies."))
    priority_class_name: str | None = Field(default=None, description="PriorityClass of the pods.")
    service_account_name: str | None = Field(default=None, description=(
        "Service account (e.g. for cloud workload identity); its API token stays unmounted."))
    resources: Resources | None = Field(default=None, description=(
        "CPU/memory requests and limits of the trainer container."))

    @field_validator("labels", "annotations")
    @classmethod
    def _not_reserved(cls, value: dict[str, str] | None,
                      info: ValidationInfo) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if key.startswith(RESERVED_PREFIX):
                raise ValueError(f"{key}: keys under {RESERVED_PREFIX} are set by the operator")
            if not _KEY.match(key):
                raise ValueError(f"{info.field_name} key {key!r} is not a Kubernetes key "
                                 "([prefix/]name, name at most 63 characters)")
            if info.field_name == "labels" and not _LABEL_VALUE.match(text):
                raise ValueError(f"label {key}: value {text!r} is not a Kubernetes label value "
                                 "(at most 63 letters, digits, '-', '_', '.')")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PodTemplate:
        names = [e.name for e in self.env or []]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"env {', '.join(dup)} given more than once")
        volumes: list[str] = []
        for v in self.volumes or []:
            name = v.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError("every podTemplate volume needs a `name`")
            if name in OPERATOR_VOLUMES:
                raise ValueError(f"volume name {name!r} is used by the operator; rename it "
                                 f"(taken: {', '.join(sorted(OPERATOR_VOLUMES))})")
            if name in volumes:
                raise ValueError(f"volume {name!r} given more than once")
            volumes.append(name)
        paths: list[str] = []
        for m in self.volume_mounts or []:
            if m.name not in volumes:
                raise ValueError(f"volumeMount {m.name!r} names no volume in podTemplate.volumes")
            path = m.mount_path.rstrip("/") or "/"
            if not path.startswith("/") or path == "/":
                raise ValueError(f"volumeMount {m.name!r}: mountPath {m.mount_path!r} must be "
                                 "absolute")
            for taken in OPERATOR_PATHS:
                if path == taken or path.startswith(taken + "/") or taken.startswith(path + "/"):
                    raise ValueError(f"volumeMount {m.name!r}: mountPath {m.mount_path!r} "
                                     f"overlaps {taken}, which the operator mounts")
            if path in paths:
                raise ValueError(f"mountPath {m.mount_path!r} used twice")
            paths.append(path)
        return self
