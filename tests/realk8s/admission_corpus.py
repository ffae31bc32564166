"""CephaloJob specs for the admission-agreement test: what the real API server says (the
judge) must be what `cephalo.api.parse_job` says. The unit battery of tests/unit/
test_crd_cel.py (checked there against an emulation) plus the cases issue 23 found: null
handling, podTemplate rules that lived only in pydantic, non-strict podTemplate types.

Each case: (id, CephaloJob object, whether it should be accepted). The expectation is
checked too, so that the server and pydantic cannot agree on a wrong verdict unnoticed."""

from __future__ import annotations

import copy
from typing import Any

from tests.unit.test_crd_cel import BATTERY, _job

Case = tuple[str, dict[str, Any], bool]


def _template(**fields: Any) -> dict[str, Any]:
    return _job({"podTemplate": fields})


SECRET, CONFIG = {"name": "s3"}, {"name": "settings"}
VOLUME = {"name": "cache", "emptyDir": {}}

PODTEMPLATE: list[Case] = [
    # envFrom: exactly one of secretRef / configMapRef (six ways to get it wrong)
    ("envfrom-secret", _template(envFrom=[{"secretRef": SECRET}]), True),
    ("envfrom-configmap-prefixed", _template(envFrom=[{"configMapRef": CONFIG,
                                                       "prefix": "APP_"}]), True),
    ("envfrom-neither", _template(envFrom=[{}]), False),
    ("envfrom-prefix-only", _template(envFrom=[{"prefix": "AWS_"}]), False),
    ("envfrom-both", _template(envFrom=[{"secretRef": SECRET, "configMapRef": CONFIG}]), False),
    ("envfrom-both-prefixed", _template(envFrom=[{"secretRef": SECRET, "configMapRef": CONFIG,
                                                  "prefix": "X_"}]), False),
    ("envfrom-second-entry-empty", _template(envFrom=[{"secretRef": SECRET}, {}]), False),
    ("envfrom-null-refs", _template(envFrom=[{"secretRef": None, "configMapRef": None}]),
     False),
    ("envfrom-ref-without-name", _template(envFrom=[{"secretRef": {}}]), False),
    # volumes and mounts
    ("volume-and-mount", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "/cache"}]), True),
    ("volume-without-name", _template(volumes=[{"emptyDir": {}}]), False),
    ("volume-empty-name", _template(volumes=[{"name": "", "emptyDir": {}}]), False),
    ("volume-operator-name", _template(volumes=[{"name": "config", "emptyDir": {}}]), False),
    ("volume-twice", _template(volumes=[VOLUME, VOLUME]), False),
    ("mount-without-volume", _template(volumeMounts=[{"name": "cache", "mountPath": "/c"}]),
     False),
    ("mount-relative", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "cache"}]), False),
    ("mount-root", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "/"}]), False),
    ("mount-under-tmp", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "/tmp/cache"}]), False),
    ("mount-above-config", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "/etc/"}]), False),
    ("mount-checkpoints-slash", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "/checkpoints/"}]), False),
    ("mount-path-twice", _template(volumes=[VOLUME, {"name": "b", "emptyDir": {}}],
                                   volumeMounts=[{"name": "cache", "mountPath": "/x"},
                                                 {"name": "b", "mountPath": "/x/"}]), False),
    ("mount-two-paths", _template(volumes=[VOLUME], volumeMounts=[
        {"name": "cache", "mountPath": "/x"}, {"name": "cache", "mountPath": "/y"}]), True),
    # resources: cpu, memory, ephemeral-storage as quantities
    ("requests-ok", _template(resources={"requests": {"cpu": "500m", "memory": "64Gi"},
                                         "limits": {"memory": 68719476736}}), True),
    ("requests-bogus-key", _template(resources={"requests": {"bogus": 1}}), False),
    ("limits-gpu", _template(resources={"limits": {"nvidia.com/gpu": 1}}), False),
    ("requests-not-quantity", _template(resources={"requests": {"cpu": "lots"}}), False),
    ("requests-bool", _template(resources={"requests": {"cpu": True}}), False),
    ("requests-fraction-string", _template(resources={"requests": {"cpu": "0.5"}}), True),
    # env
    ("env-ok", _template(env=[{"name": "WANDB_MODE", "value": "offline"},
                              {"name": "TOKEN", "valueFrom": {
                                  "secretKeyRef": {"name": "s", "key": "k"}}}]), True),
    ("env-reserved-cephalo", _template(env=[{"name": "CEPHALO_PLAN", "value": "/x"}]), False),
    ("env-reserved-rank", _template(env=[{"name": "RANK", "value": "0"}]), False),
    ("env-reserved-home", _template(env=[{"name": "HOME", "value": "/root"}]), False),
    ("env-bad-name", _template(env=[{"name": "1ABC", "value": "x"}]), False),
    ("env-value-and-from", _template(env=[{"name": "A", "value": "x", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}}}]), False),
    ("env-twice", _template(env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
     False),
    ("env-value-int", _template(env=[{"name": "A", "value": 1}]), False),
    # labels and annotations
    ("labels-ok", _template(labels={"team": "nlp", "kueue.x-k8s.io/queue-name": "gpu"},
                            annotations={"example.com/owner": "x y z"}), True),
    ("label-reserved", _template(labels={"cephalo.dev/role": "x"}), False),
    ("annotation-reserved", _template(annotations={"cephalo.dev/config-hash": "x"}), False),
    ("label-value-64", _template(labels={"team": "a" * 64}), False),
    ("label-value-spaces", _template(labels={"team": "a b"}), False),
    ("label-key-bad", _template(labels={"-team": "a"}), False),
    ("label-value-int", _template(labels={"team": 1}), False),
    # tolerations and the rest
    ("toleration-ok", _template(tolerations=[{"key": "spot", "operator": "Exists",
                                              "effect": "NoExecute",
                                              "tolerationSeconds": 30}]), True),
    ("toleration-seconds-bool", _template(tolerations=[{"tolerationSeconds": True}]), False),
    ("toleration-seconds-string", _template(tolerations=[{"tolerationSeconds": "30"}]), False),
    ("toleration-operator-bogus", _template(tolerations=[{"operator": "Maybe"}]), False),
    ("toleration-effect-null", _template(tolerations=[{"key": "a", "effect": None}]), True),
    ("pull-secret-without-name", _template(imagePullSecrets=[{}]), False),
    ("affinity-passthrough", _template(affinity={"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": []}}), True),
    ("podtemplate-unknown-field", _template(hostNetwork=True), False),
    ("podtemplate-null", _job({"podTemplate": None}), True),
    ("service-account-int", _template(serviceAccountName=3), False),
]

NULLS: list[Case] = [
    # A null optional member is the same as leaving it out, for pydantic and the server.
    ("data-synthetic-null", _job(data={"synthetic": None}), False),
    ("data-token-file-null", _job(data={"tokenFile": None}), False),
    ("data-synthetic-null-token-file", _job(data={"synthetic": None, "tokenFile": {
        "path": "/data/x.bin"}}), True),
    ("preset-family-null", _job(model={"preset": "gpt-tiny", "family": None}), True),
    ("precision-null", _job(precision=None), True),
    ("dtype-null", _job(data={"tokenFile": {"path": "/x.bin", "dtype": None}}), True),
    ("dtype-bogus", _job(data={"tokenFile": {"path": "/x.bin", "dtype": "int8"}}), False),
    ("image-null", _job(image=None), True),
    ("max-gpus-null", _job(maxGpus=None), True),
    ("checkpoint-claim-null", _job(checkpoint={"claimName": None}), True),
    ("pools-null", _job(gpuPools=None), True),
    ("scheduling-null", _job(schedulingPolicy=None), True),
    ("suspend-null", _job(suspend=None), True),
    ("unknown-spec-field", _job(replicas=3), False),
]

ELASTIC: list[Case] = [
    ("elastic-rescale-timeout", _job(elastic={"enabled": True, "rescaleTimeoutSeconds": 60}),
     True),
    ("elastic-rescale-timeout-zero", _job(elastic={"enabled": True,
                                                   "rescaleTimeoutSeconds": 0}), False),
    ("elastic-rescale-timeout-fraction", _job(elastic={"rescaleTimeoutSeconds": 1.5}), False),
    ("elastic-null", _job(elastic=None), True),
    ("elastic-unknown-field", _job(elastic={"enabled": True, "rollbacks": 1}), False),
]


def corpus() -> list[Case]:
    cases = [*BATTERY, *PODTEMPLATE, *NULLS, *ELASTIC]
    ids = [c[0] for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return [(i, copy.deepcopy(o), v) for i, o, v in cases]
