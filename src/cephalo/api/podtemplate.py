"""`spec.podTemplate`: what a team adds to every rank and profiler pod (storage credentials,
loggers, node placement, priority, CPU/memory), merged by the operator with its own fields.

Kubernetes sub-objects the operator only passes through (volumes, affinity, an env var's
valueFrom) are plain dicts: the CRD keeps them with `x-kubernetes-preserve-unknown-fields`
and the API server validates them when it creates the pod. What the operator must own is
refused here, at admission, with a message saying why: the trainer's environment contract,
the volumes and paths it mounts, its labels and annotations, the GPU resource.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from cephalo.api.podtemplate_rules import (
    ALLOWED_RESOURCES,
    CONTRACT_ENV,
    ENV_NAME,
    ENV_NAME_PATTERN,
    KEY,
    LABEL_VALUE,
    LABEL_VALUE_PATTERN,
    OPERATOR_PATHS,
    OPERATOR_VOLUMES,
    QUANTITY,
    QUANTITY_PATTERN,
    RESERVED_PREFIX,
    env_from_rules,
    env_rules,
    key_rules,
    mount_rules,
    pod_template_rules,
    resource_rules,
    strip_one_slash,
    volume_rules,
)
from cephalo.api.wire import CamelModel

__all__ = [
    "ALLOWED_RESOURCES",
    "CONTRACT_ENV",
    "OPERATOR_PATHS",
    "OPERATOR_VOLUMES",
    "RESERVED_PREFIX",
    "PodTemplate",
]

# Bounds on every list, map and string a CEL rule reads: the API server prices a rule by
# the largest input the schema allows and refuses a CRD over its budget.
MAX_ITEMS = 64
MAX_NAME_CHARS = 253
MAX_PATH_CHARS = 4096
# The duplicate-mountPath rule compares every pair of mounts: 64 x 64 x 1024 characters
# fits the budget (4096 characters was refused by the API server at twice its budget).
MAX_MOUNT_PATH_CHARS = 1024
# Strict types (true is not 1), no unknown keys, null the same as absent: the API server's
# view of the CRD schema (cephalo.api.wire).
_Model = CamelModel
# A Kubernetes volume: passed through to the pods, but named (a DNS label, not one of the
# operator's), so mounts can refer to it and the CRD can check it.
Volume = Annotated[dict[str, Any], Field(json_schema_extra={
    "required": ["name"], "properties": {"name": {
        "type": "string", "minLength": 1, "maxLength": 63,
        "description": "Volume name (a DNS label, not one of the operator's)."}},
    "x-kubernetes-validations": volume_rules()})]
# cpu: 8, memory: "64Gi": a Kubernetes quantity, an integer or a string.
Quantity = Annotated[int | str, WithJsonSchema({
    "x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN, "maxLength": 64,
    "minimum": 0})]


class EnvVar(_Model):
    """An environment variable: a value, or `valueFrom` (a secretKeyRef, configMapKeyRef, …)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": env_rules()})

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, json_schema_extra={
        "pattern": ENV_NAME_PATTERN}, description="Variable name (not one the operator sets).")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(default=None, description=(
        "Kubernetes EnvVarSource, e.g. {secretKeyRef: {name: s3, key: secret}}."))

    @model_validator(mode="after")
    def _checked(self) -> EnvVar:
        if not ENV_NAME.match(self.name):
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

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="Secret name.")
    optional: bool | None = Field(default=None, description="Start even if it is missing.")


class ConfigMapRef(_Model):
    """A ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="ConfigMap name.")
    optional: bool | None = Field(default=None, description="Start even if it is missing.")


class PullSecret(_Model):
    """A docker-registry Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, description="Secret name.")


class EnvFromSource(_Model):
    """All keys of a Secret or ConfigMap as environment variables (e.g. AWS credentials)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": env_from_rules()})

    prefix: str | None = Field(default=None, max_length=MAX_NAME_CHARS,
                               description="Prepended to every key.")
    secret_ref: SecretRef | None = Field(default=None, description="Secret to read.")
    config_map_ref: ConfigMapRef | None = Field(default=None, description="ConfigMap to read.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("envFrom entries need exactly one of secretRef or configMapRef")
        return self


class VolumeMount(_Model):
    """Where one of podTemplate.volumes appears in the trainer container."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": mount_rules()})

    name: str = Field(min_length=1, max_length=63, description="A volume from podTemplate.volumes.")
    mount_path: str = Field(min_length=1, max_length=MAX_MOUNT_PATH_CHARS,
                            description="Absolute path in the container.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    sub_path: str | None = Field(default=None, max_length=MAX_PATH_CHARS,
                                 description="Mount only this path of the volume.")


class Toleration(_Model):
    """Lets rank and profiler pods onto nodes with a matching taint."""

    key: str | None = Field(default=None, max_length=MAX_NAME_CHARS + 64,
                            description="Taint key (none: every taint).")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description=(
        "Equal (default) compares the value; Exists matches any value."))
    value: str | None = Field(default=None, max_length=63,
                              description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate (none: all).")
    toleration_seconds: int | None = Field(default=None, ge=0, description=(
        "NoExecute only: how long the pod stays after the taint appears."))


def _resource_map(description: str) -> Any:
    return Field(default=None, max_length=len(ALLOWED_RESOURCES), description=description,
                 json_schema_extra={"x-kubernetes-validations": resource_rules()})


class Resources(_Model):
    """CPU, memory and ephemeral-storage requests/limits of the trainer container (values are
    Kubernetes quantities: 8, "500m", "64Gi"). GPUs come from the plan, one per rank."""

    requests: dict[str, Quantity] | None = _resource_map(
        "Guaranteed resources, e.g. {cpu: 8, memory: 64Gi}.")
    limits: dict[str, Quantity] | None = _resource_map(
        "Caps, e.g. {memory: 64Gi} (the container is killed above it).")

    @field_validator("requests", "limits", mode="before")
    @classmethod
    def _allowed(cls, value: Any, info: ValidationInfo) -> Any:
        # Before the type check, so a GPU key is refused with what to do, not "too many keys".
        for name in value or {} if isinstance(value, dict) else {}:
            if name not in ALLOWED_RESOURCES:
                raise ValueError(
                    f"resources.{info.field_name}.{name}: only "
                    f"{', '.join(sorted(ALLOWED_RESOURCES))} may be set here; GPUs come from "
                    "the plan (one per rank)")
        return value

    @model_validator(mode="after")
    def _quantities(self) -> Resources:
        for kind in ("requests", "limits"):
            for name, value in (getattr(self, kind) or {}).items():
                if (isinstance(value, int) and value < 0) or not QUANTITY.match(str(value)) \
                        or len(str(value)) > 64:
                    raise ValueError(f"resources.{kind}.{name}: {value!r} is not a Kubernetes "
                                     "quantity (e.g. 8, \"500m\", \"64Gi\")")
        return self


def _map(what: str, values: dict[str, Any], description: str) -> Any:
    return Field(default=None, max_length=MAX_ITEMS, description=description, json_schema_extra={
        "additionalProperties": values, "x-kubernetes-validations": key_rules(what)})


def _list(description: str, key: str | None = None) -> Any:
    extra: dict[str, Any] = {}
    if key is not None:  # duplicates refused by the API server (a list keyed by `key`)
        extra = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}
    return Field(default=None, max_length=MAX_ITEMS, description=description,
                 json_schema_extra=extra or None)


class PodTemplate(_Model):
    """Additions to every rank and profiler pod; the operator's own fields win (GPU resource,
    nodeSelector, trainer environment, security context, its volumes and labels)."""

    model_config = ConfigDict(json_schema_extra={
        "x-kubernetes-validations": pod_template_rules()})

    labels: dict[str, str] | None = _map("label", {
        "type": "string", "maxLength": 63, "pattern": LABEL_VALUE_PATTERN},
        "Extra pod labels (not cephalo.dev/*), e.g. kueue.x-k8s.io/queue-name.")
    annotations: dict[str, str] | None = _map("annotation", {"type": "string"},
                                              "Extra pod annotations (not cephalo.dev/*).")
    env: list[EnvVar] | None = _list("Extra environment variables of the trainer container.",
                                     key="name")
    env_from: list[EnvFromSource] | None = _list(
        "Secrets/ConfigMaps whose keys become environment variables (storage credentials).")
    volumes: list[Volume] | None = _list(
        "Extra Kubernetes volumes (each with a name); mount them with volumeMounts.", key="name")
    volume_mounts: list[VolumeMount] | None = _list(
        "Mounts of podTemplate.volumes in the trainer container.")
    image_pull_secrets: list[PullSecret] | None = _list(
        "Secrets for pulling the trainer image from a private registry.")
    tolerations: list[Toleration] | None = _list(
        "Extra tolerations (the GPU taint nvidia.com/gpu is always tolerated).")
    affinity: dict[str, Any] | None = Field(default=None, description=(
        "Kubernetes affinity; the GPU product's nodeSelector still applies."))
    priority_class_name: str | None = Field(default=None, max_length=MAX_NAME_CHARS,
                                            description="PriorityClass of the pods.")
    service_account_name: str | None = Field(default=None, max_length=MAX_NAME_CHARS,
                                             description=(
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
            if not KEY.match(key):
                raise ValueError(f"{info.field_name} key {key!r} is not a Kubernetes key "
                                 "([prefix/]name, name at most 63 characters)")
            if info.field_name == "labels" and not LABEL_VALUE.match(text):
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
            if not isinstance(name, str) or not name or len(name) > 63:
                raise ValueError("every podTemplate volume needs a `name` (at most 63 "
                                 "characters)")
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
            # One trailing slash dropped, not all: the CRD's CEL rule says the same.
            if strip_one_slash(m.mount_path) in paths:
                raise ValueError(f"mountPath {m.mount_path!r} used twice")
            paths.append(strip_one_slash(m.mount_path))
        return self
