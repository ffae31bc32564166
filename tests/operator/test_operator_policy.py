"""Issue 39 item 9: the operator refuses, before it creates any pod, a job whose podTemplate
asks for a volume type or a service account the chart's jobPolicy does not allow (the
check for clusters without the chart's ValidatingAdmissionPolicy, and jobs admitted before
it). Pure checks, the settings as the chart passes them, and the real kopf operator over
HTTP against the API emulator."""

from __future__ import annotations

import json
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

from cephalo.api.podtemplate import PodTemplate
from cephalo.operator.config import OperatorConfig
from cephalo.operator.policy import RESTRICTED_VOLUME_TYPES, VOLUME_TYPES, JobPolicy, refusal

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "cephalo-operator"
HOST_PATH = {"name": "h", "hostPath": {"path": "/"}}
MOUNT = [{"name": "h", "mountPath": "/host"}]


def _template(**fields: object) -> PodTemplate:
    return PodTemplate.model_validate(fields)


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
    assert refusal(None, JobPolicy()) is None and refusal(_template(), JobPolicy()) is None


def test_settings_as_the_chart_passes_them() -> None:
    config = OperatorConfig.from_env({
        "CEPHALO_ALLOWED_VOLUME_TYPES": "emptyDir, hostPath",
        "CEPHALO_ALLOW_SERVICE_ACCOUNT_NAME": "true",
        "CEPHALO_ALLOWED_SERVICE_ACCOUNT_NAMES": "trainer,reader"})
    assert config.job_policy() == JobPolicy(frozenset({"emptyDir", "hostPath"}), True,
                                            frozenset({"trainer", "reader"}))
    assert OperatorConfig().job_policy() == JobPolicy()  # secure without the chart too
    with pytest.raises(ValueError, match="CEPHALO_ALLOWED_VOLUME_TYPES: hostpath: not a "
                                         "Kubernetes volume type"):
        OperatorConfig.from_env({"CEPHALO_ALLOWED_VOLUME_TYPES": "emptyDir,hostpath"})


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
