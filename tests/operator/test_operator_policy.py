"""Issue 39 item 9 and issue 46 item 7: the operator refuses, before it creates any pod, a job
that asks for a volume type, a service account, an image, a PriorityClass or a toleration
the chart's jobPolicy does not allow (the check for clusters without the chart's
ValidatingAdmissionPolicy, and jobs admitted before it). Pure checks, the settings as the
chart passes them, and the real kopf operator over HTTP against the API emulator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import apply_job, pods, wait_for
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    SMALL,
    cond,
    events,
    operator_fixture,
    start_operator_fixture,
    wait_phase,
)

from cephalo.api.job import CephaloJobSpec
from cephalo.operator.config import OperatorConfig
from cephalo.operator.policy import (
    RESTRICTED_VOLUME_TYPES,
    VOLUME_TYPES,
    AllowedToleration,
    JobPolicy,
    refusal,
)

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "cephalo-operator"
HOST_PATH = {"name": "h", "hostPath": {"path": "/"}}
MOUNT = [{"name": "h", "mountPath": "/host"}]


def _template(**fields: object) -> CephaloJobSpec:
    """A job spec (image registry.example/cephalo-trainer:0.1.0) with this podTemplate."""
    return CephaloJobSpec.model_validate(job_body(podTemplate=fields)["spec"])


def _spec(**fields: object) -> CephaloJobSpec:
    return CephaloJobSpec.model_validate(job_body(**fields)["spec"])


def test_default_policy_refuses_host_path_naming_the_volume_and_the_value() -> None:
    said = refusal(_template(volumes=[{"name": "e", "emptyDir": {}}, HOST_PATH],
                             volumeMounts=MOUNT), JobPolicy())
    assert said is not None
    assert "volume h is hostPath" in said and "volume e" not in said
    assert "allowed: configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, "\
           "projected, secret" in said
    assert "jobPolicy.allowedVolumeTypes" in said


@pytest.mark.parametrize("volume", [
    {"name": "c", "configMap": {"name": "x"}}, {"name": "s", "secret": {"secretName": "x"}},
    {"name": "p", "persistentVolumeClaim": {"claimName": "x"}}, {"name": "e", "emptyDir": {}},
    {"name": "bare"},  # no type: the API server makes it an emptyDir
    {"name": "csi", "csi": {"driver": "x"}}, {"name": "eph", "ephemeral": {}},
    {"name": "pr", "projected": {"sources": []}}, {"name": "d", "downwardAPI": {}}])
def test_default_policy_admits_the_restricted_volume_types(volume: dict[str, object]) -> None:
    assert refusal(_template(volumes=[volume]), JobPolicy()) is None


@pytest.mark.parametrize("volume", [
    HOST_PATH, {"name": "n", "nfs": {"server": "x", "path": "/"}},
    {"name": "g", "gitRepo": {"repository": "x"}}, {"name": "i", "image": {"reference": "x"}}])
def test_default_policy_refuses_every_other_volume_type(volume: dict[str, object]) -> None:
    said = refusal(_template(volumes=[volume]), JobPolicy())
    assert said is not None and f"volume {volume['name']} is " in said


def test_opting_in_a_volume_type_admits_it_and_only_it() -> None:
    policy = JobPolicy(volume_types=frozenset({*RESTRICTED_VOLUME_TYPES, "hostPath"}))
    assert refusal(_template(volumes=[HOST_PATH], volumeMounts=MOUNT), policy) is None
    said = refusal(_template(volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}]),
                   policy)
    assert said is not None and "volume n is nfs" in said


def test_service_account_refused_unless_allowed_and_listed() -> None:
    account = _template(serviceAccountName="trainer")
    said = refusal(account, JobPolicy())
    assert said is not None and "serviceAccountName trainer is not allowed" in said
    assert "jobPolicy.serviceAccountName.allowed" in said
    assert refusal(account, JobPolicy(service_account_allowed=True)) is None  # any name
    listed = JobPolicy(service_account_allowed=True,
                       service_account_names=frozenset({"trainer"}))
    assert refusal(account, listed) is None
    said = refusal(_template(serviceAccountName="admin"), listed)
    assert said is not None and "admin is not one this cluster's Cephalo policy allows " \
        "(trainer)" in said and "jobPolicy.serviceAccountName.names" in said
    assert refusal(_spec(), JobPolicy()) is None and refusal(_template(), JobPolicy()) is None


IMAGES = JobPolicy(image_prefixes=("registry.example.com", "ghcr.io/cephalo/cephalo-trainer"))


@pytest.mark.parametrize("image", [
    "registry.example.com/ml/trainer:1.0", "registry.example.com/x@sha256:" + "a" * 64,
    "ghcr.io/cephalo/cephalo-trainer", "ghcr.io/cephalo/cephalo-trainer:0.1.0",
    "ghcr.io/cephalo/cephalo-trainer@sha256:" + "b" * 64])
def test_an_image_under_an_allowed_prefix_is_admitted(image: str) -> None:
    assert refusal(_spec(image=image), IMAGES) is None


@pytest.mark.parametrize("image", [
    "docker.io/library/python:3.12", "python:3.12",  # Docker Hub, written or implied
    "registry.example.com.evil.io/trainer:1",  # the host name as a string prefix only
    "registry.example.com:5000/trainer:1",  # another port: another registry
    "ghcr.io/cephalo/cephalo-trainer-evil:1",  # a repository sharing the name's start
    "ghcr.io/cephalo/other:1"])
def test_an_image_elsewhere_is_refused_naming_it_and_the_value(image: str) -> None:
    said = refusal(_spec(image=image), IMAGES)
    assert said == (
        f"spec.image {image}: not from a registry this cluster's Cephalo policy allows "
        "(allowed: registry.example.com, ghcr.io/cephalo/cephalo-trainer); use an image from "
        "one of those, or ask a cluster admin to add its registry to the chart value "
        "jobPolicy.allowedImagePrefixes")


def test_an_image_volume_is_judged_like_spec_image() -> None:
    """podTemplate can carry an image of its own: an `image` volume (an OCI artifact)."""
    policy = JobPolicy(volume_types=frozenset({"image"}),
                       image_prefixes=("registry.example",))
    said = refusal(_template(volumes=[{"name": "w", "image": {"reference": "evil.io/w:1"}},
                                      {"name": "ok", "image": {
                                          "reference": "registry.example/w:1"}}]), policy)
    assert said is not None and said.startswith(
        "podTemplate.volumes: volume w image evil.io/w:1: not from a registry")
    assert "volume ok" not in said


def test_no_image_prefixes_admit_every_image_and_spec_image_unset_is_the_operators() -> None:
    assert refusal(_spec(image="python:3.12"), JobPolicy()) is None
    assert refusal(_spec(image=None), IMAGES) is None  # the chart's trainerImage: the admin's


CLASSES = JobPolicy(priority_class_names=frozenset({"batch-low", "batch"}))


def test_priority_classes_of_pods_and_pod_group_must_be_listed() -> None:
    assert refusal(_template(priorityClassName="batch"), CLASSES) is None
    assert refusal(_spec(schedulingPolicy={"priorityClassName": "batch-low"}), CLASSES) is None
    said = refusal(_spec(podTemplate={"priorityClassName": "system-node-critical"},
                         schedulingPolicy={"priorityClassName": "urgent"}), CLASSES)
    assert said == (
        "podTemplate.priorityClassName system-node-critical, schedulingPolicy."
        "priorityClassName urgent: not a PriorityClass this cluster's Cephalo policy allows "
        "(allowed: batch, batch-low); use one of those, or ask a cluster admin to add it to "
        "the chart value jobPolicy.allowedPriorityClassNames")
    # no list: any PriorityClass (as before the list existed)
    assert refusal(_template(priorityClassName="system-node-critical"), JobPolicy()) is None


TOLERATIONS = JobPolicy(tolerations=frozenset({
    AllowedToleration("dedicated", "NoSchedule"), AllowedToleration("example.com/spot")}))


@pytest.mark.parametrize("toleration", [
    {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
    {"key": "example.com/spot", "operator": "Exists"},  # a key alone: every effect
    {"key": "example.com/spot", "operator": "Exists", "effect": "NoExecute"}])
def test_an_allowed_toleration_is_admitted(toleration: dict[str, str]) -> None:
    assert refusal(_template(tolerations=[toleration]), TOLERATIONS) is None


@pytest.mark.parametrize(("toleration", "named"), [
    ({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"},
     "key dedicated effect NoExecute"),
    ({"key": "dedicated", "operator": "Exists"}, "key dedicated with every effect"),
    ({"key": "node.kubernetes.io/unreachable", "operator": "Exists"},
     "key node.kubernetes.io/unreachable with every effect"),
    ({"operator": "Exists"}, "one without a key (it tolerates every taint)")])
def test_another_toleration_is_refused_naming_it(toleration: dict[str, str], named: str) -> None:
    said = refusal(_template(tolerations=[toleration]), TOLERATIONS)
    assert said == (
        f"podTemplate.tolerations: {named}: not a toleration this cluster's Cephalo policy "
        "allows (allowed: dedicated:NoSchedule, example.com/spot); use one of those, or ask "
        "a cluster admin to add it to the chart value jobPolicy.allowedTolerations")


def test_no_toleration_list_admits_every_toleration() -> None:
    assert refusal(_template(tolerations=[{"operator": "Exists"}]), JobPolicy()) is None


def test_settings_as_the_chart_passes_them() -> None:
    config = OperatorConfig.from_env({
        "CEPHALO_ALLOWED_VOLUME_TYPES": "emptyDir, hostPath",
        "CEPHALO_ALLOW_SERVICE_ACCOUNT_NAME": "true",
        "CEPHALO_ALLOWED_SERVICE_ACCOUNT_NAMES": "trainer,reader",
        "CEPHALO_ALLOWED_IMAGE_PREFIXES": "registry.example.com/ml/,localhost:5000",
        "CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES": "batch, batch-low",
        "CEPHALO_ALLOWED_TOLERATIONS": "dedicated:NoSchedule,example.com/spot"})
    assert config.job_policy() == JobPolicy(
        frozenset({"emptyDir", "hostPath"}), True, frozenset({"trainer", "reader"}),
        ("registry.example.com/ml", "localhost:5000"), frozenset({"batch", "batch-low"}),
        frozenset({AllowedToleration("dedicated", "NoSchedule"),
                   AllowedToleration("example.com/spot")}))
    assert OperatorConfig().job_policy() == JobPolicy()  # secure without the chart too
    assert JobPolicy().image_prefixes == () and not JobPolicy().priority_class_names \
        and not JobPolicy().tolerations  # unset: no restriction, existing jobs keep running


@pytest.mark.parametrize(("env", "said"), [
    ({"CEPHALO_ALLOWED_VOLUME_TYPES": "emptyDir,hostpath"},
     "CEPHALO_ALLOWED_VOLUME_TYPES: hostpath: not a Kubernetes volume type"),
    # Docker Hub's user "myregistry", not a registry: a prefix starts with a registry host
    ({"CEPHALO_ALLOWED_IMAGE_PREFIXES": "myregistry/ml"},
     "CEPHALO_ALLOWED_IMAGE_PREFIXES: myregistry/ml: not a registry prefix"),
    ({"CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES": "Batch"},
     "CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES: Batch: not a Kubernetes object name"),
    ({"CEPHALO_ALLOWED_TOLERATIONS": "dedicated:NoSchedul"},
     "CEPHALO_ALLOWED_TOLERATIONS: dedicated:NoSchedul: not a toleration key or key:effect"),
])
def test_a_bad_policy_setting_is_refused_at_start_up(env: dict[str, str], said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        OperatorConfig.from_env(env)


def test_volume_types_are_the_charts() -> None:
    """The operator and the chart's values.schema.json know the same volume types, and the
    chart's default is the operator's."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    node = schema["properties"]["jobPolicy"]["properties"]["allowedVolumeTypes"]
    assert set(node["items"]["enum"]) == VOLUME_TYPES
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["jobPolicy"]
    assert tuple(values["allowedVolumeTypes"]) == RESTRICTED_VOLUME_TYPES
    assert values["serviceAccountName"] == {"allowed": False, "names": []}


@pytest.mark.asyncio
async def test_operator_fails_a_forbidden_job_before_any_pod(emulator: ApiEmulator,
                                                            operator: object) -> None:
    body = job_body("hostly", podTemplate={"volumes": [HOST_PATH], "volumeMounts": MOUNT,
                                           "serviceAccountName": "default"}, **SMALL)
    await apply_job(emulator, body)
    status = await wait_phase(emulator, "hostly", "Failed")
    failed = cond(emulator, "hostly", "Failed")
    assert failed["reason"] == "PolicyDenied"
    assert "volume h is hostPath" in status["message"]
    assert "serviceAccountName default is not allowed" in status["message"]
    assert not any(name.startswith("hostly-") for _, name in emulator.created("pods"))
    assert pods(emulator, NS, "profiler", "hostly") == []
    await wait_for("PolicyDenied event", lambda: any(
        r == "PolicyDenied" and "volume h is hostPath" in m
        for _, r, m in events(emulator, "hostly")))


@pytest.mark.asyncio
async def test_operator_runs_what_its_settings_opt_in(emulator: ApiEmulator,
                                                      start_operator) -> None:
    start_operator(CEPHALO_ALLOWED_VOLUME_TYPES=",".join([*RESTRICTED_VOLUME_TYPES, "hostPath"]))
    body = job_body("hosted", podTemplate={"volumes": [HOST_PATH], "volumeMounts": MOUNT},
                    **SMALL)
    await apply_job(emulator, body)
    profilers = await wait_for("profiler pods", lambda: pods(emulator, NS, "profiler",
                                                             "hosted"))
    assert HOST_PATH in profilers[0]["spec"]["volumes"]


@pytest.mark.asyncio
async def test_operator_fails_a_job_outside_its_image_priority_and_toleration_lists(
        emulator: ApiEmulator, start_operator) -> None:
    """Issue 46 item 7: a job the admission policy did not see (created before it, or with
    it off) is failed before any pod, as a forbidden volume is."""
    start_operator(CEPHALO_ALLOWED_IMAGE_PREFIXES="registry.example.com/ml",
                   CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES="batch",
                   CEPHALO_ALLOWED_TOLERATIONS="dedicated:NoSchedule")
    body = job_body("elsewhere", image="docker.io/evil/trainer:1",
                    podTemplate={"priorityClassName": "system-node-critical",
                                 "tolerations": [{"operator": "Exists"}]}, **SMALL)
    await apply_job(emulator, body)
    status = await wait_phase(emulator, "elsewhere", "Failed")
    assert cond(emulator, "elsewhere", "Failed")["reason"] == "PolicyDenied"
    for said in ("spec.image docker.io/evil/trainer:1: not from a registry",
                 "podTemplate.priorityClassName system-node-critical: not a PriorityClass",
                 "podTemplate.tolerations: one without a key"):
        assert said in status["message"], status["message"]
    assert not any(name.startswith("elsewhere-") for _, name in emulator.created("pods"))
    await wait_for("PolicyDenied event", lambda: any(
        r == "PolicyDenied" and "spec.image docker.io/evil/trainer:1" in m
        for _, r, m in events(emulator, "elsewhere")))
