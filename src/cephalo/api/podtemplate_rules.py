"""What `spec.podTemplate` may not touch, and the same rules as CEL
(`x-kubernetes-validations`) for the CRD, so that `kubectl apply` refuses what
`cephalo.api.podtemplate` refuses instead of the job failing later with InvalidSpec.

Every rule reads only fields with a `maxLength` / `maxItems` / `maxProperties` bound (see
the models): the API server refuses a CRD whose rules could cost more than its CEL budget.
Regular expressions are RE2-compatible: CEL's matches() and OpenAPI `pattern` use RE2.
"""

from __future__ import annotations

import re

from pydantic.config import JsonValue

from cephalo.api.trainer_env import OPERATOR_SET

# Environment variables the operator sets on rank and profiler pods (the trainer contract of
# cephalo.api.trainer_env, plus HOME, which must point at the writable /tmp under a read-only
# root).
CONTRACT_ENV = frozenset({*OPERATOR_SET, "HOME"})
# Volumes the operator mounts, by name and path (the token-file volume's path is the job's
# data.tokenFile.mountPath; the operator checks that one when it renders).
OPERATOR_VOLUMES = frozenset({"config", "tmp", "dshm", "checkpoints", "dataset"})
OPERATOR_PATHS = ("/etc/cephalo", "/tmp", "/dev/shm", "/checkpoints")
RESERVED_PREFIX = "cephalo.dev/"
# CPU and memory are the team's to size; accelerators come from the plan (one per rank).
ALLOWED_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})
QUANTITY_PATTERN = r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[KMGTPE]i|[numkMGTPE])?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Kubernetes label/annotation keys ([DNS-subdomain prefix/]name) and label values: the API
# server would refuse the pods much later, one reconcile at a time.
_NAME_63 = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
KEY_PATTERN = rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME_63}$"
LABEL_VALUE_PATTERN = rf"^{_NAME_63}?$"
MAX_KEY_CHARS = 253 + 1 + 63  # prefix / name
QUANTITY = re.compile(QUANTITY_PATTERN)
ENV_NAME = re.compile(ENV_NAME_PATTERN)
KEY = re.compile(KEY_PATTERN)
LABEL_VALUE = re.compile(LABEL_VALUE_PATTERN)


def _cel_list(values: frozenset[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in sorted(values)) + "]"


def _cel_regex(pattern: str) -> str:
    return pattern.replace("\\", "\\\\")  # inside a single-quoted CEL string


def env_rules() -> list[JsonValue]:
    return [
        {"rule": f"!(self.name in {_cel_list(CONTRACT_ENV)})",
         "message": "this env var is set by the operator (the trainer's environment contract, "
                    "and HOME); remove it from podTemplate.env"},
        {"rule": "!(has(self.value) && has(self.valueFrom))",
         "message": "an env var takes `value` or `valueFrom`, not both"},
    ]


def env_from_rules() -> list[JsonValue]:
    return [{"rule": "has(self.secretRef) != has(self.configMapRef)",
             "message": "envFrom entries need exactly one of secretRef or configMapRef"}]


def volume_rules() -> list[JsonValue]:
    return [{"rule": f"!(self.name in {_cel_list(OPERATOR_VOLUMES)})",
             "message": "this volume name is used by the operator; rename it (taken: "
                        f"{', '.join(sorted(OPERATOR_VOLUMES))})"}]


def _under(paths: tuple[str, ...]) -> str:
    return "^(" + "|".join(re.escape(p) for p in paths) + ")(/.*)?$"


def _parents(paths: tuple[str, ...]) -> str:
    parents = sorted({p.rsplit("/", 1)[0] for p in paths if p.count("/") > 1})
    return "^(" + "|".join(re.escape(p) for p in parents) + ")/*$"


def mount_rules() -> list[JsonValue]:
    return [
        {"rule": "self.mountPath.matches('^/.*[^/]')",
         "message": "mountPath must be an absolute path other than /"},
        {"rule": (f"!self.mountPath.matches('{_cel_regex(_under(OPERATOR_PATHS))}') && "
                  f"!self.mountPath.matches('{_cel_regex(_parents(OPERATOR_PATHS))}')"),
         "message": "mountPath overlaps a path the operator mounts "
                    f"({', '.join(OPERATOR_PATHS)})"},
    ]


def strip_one_slash(path: str) -> str:
    """The mount path compared for duplicates: one trailing '/' dropped (what CEL can say)."""
    return path[:-1] if path.endswith("/") else path


def pod_template_rules() -> list[JsonValue]:
    same = ("(m.mountPath.endsWith('/') ? m.mountPath.substring(0, size(m.mountPath) - 1) : "
            "m.mountPath)")
    other = same.replace("m.", "n.")
    return [
        {"rule": ("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
                  "self.volumes.exists(v, v.name == m.name))"),
         "message": "every volumeMount must name a volume in podTemplate.volumes"},
        {"rule": (f"!has(self.volumeMounts) || self.volumeMounts.all(m, "
                  f"self.volumeMounts.exists_one(n, {other} == {same}))"),
         "message": "a mountPath is used twice in podTemplate.volumeMounts"},
    ]


def key_rules(what: str) -> list[JsonValue]:
    return [{"rule": (f"self.all(k, !k.startsWith('{RESERVED_PREFIX}') && size(k) <= "
                      f"{MAX_KEY_CHARS} && k.matches('{_cel_regex(KEY_PATTERN)}'))"),
             "message": f"{what} keys must be Kubernetes keys ([prefix/]name, name at most 63 "
                        f"characters), not under {RESERVED_PREFIX} (set by the operator)"}]


def resource_rules() -> list[JsonValue]:
    return [{"rule": f"self.all(k, k in {_cel_list(ALLOWED_RESOURCES)})",
             "message": f"only {', '.join(sorted(ALLOWED_RESOURCES))} may be set here; GPUs "
                        "come from the plan (one per rank)"}]
