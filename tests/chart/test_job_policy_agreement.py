"""Issue 46 item 7: the chart's two enforcers of jobPolicy agree. The ValidatingAdmissionPolicy
rendered by the real Helm engine, its CEL run by an independent interpreter (cel-python),
and the operator configured from the same render's environment variables admit and refuse
the same jobs: images by registry, priority classes, tolerations (and the older volume and
service-account rules alongside). The real kube-apiserver runs the same policy in
tests/realk8s/test_job_policy.py."""

from __future__ import annotations

import sys
from typing import Any

import celpy
import pytest
from chart_helpers import ROOT, one, render

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from kube_fixtures import job_body

from cephalo.api.job import CephaloJobSpec
from cephalo.operator.config import OperatorConfig
from cephalo.operator.policy import JobPolicy, refusal

RESTRICTED: dict[str, Any] = {"jobPolicy": {
    "allowedVolumeTypes": ["emptyDir", "image"],
    "allowedImagePrefixes": ["registry.example.com/", "ghcr.io/cephalo/cephalo-trainer"],
    "allowedPriorityClassNames": ["batch", "batch-low"],
    "allowedTolerations": [{"key": "dedicated", "effect": "NoSchedule"},
                           {"key": "example.com/spot"}]}}


def _image_volume(reference: str) -> dict[str, Any]:
    return {"volumes": [{"name": "w", "image": {"reference": reference}}]}


# (what, spec fields, refused by RESTRICTED): each new rule allowed and denied.
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("host", {"image": "registry.example.com/ml/trainer:1"}, False),
    ("repository-tag", {"image": "ghcr.io/cephalo/cephalo-trainer:0.1.0"}, False),
    ("repository-digest", {"image": "ghcr.io/cephalo/cephalo-trainer@sha256:" + "a" * 64},
     False),
    ("no-image", {"image": None}, False),
    ("docker-hub", {"image": "python:3.12"}, True),
    ("host-as-string-prefix", {"image": "registry.example.com.evil.io/trainer:1"}, True),
    ("other-port", {"image": "registry.example.com:5000/trainer:1"}, True),
    ("repository-as-string-prefix", {"image": "ghcr.io/cephalo/cephalo-trainer-evil:1"}, True),
    ("image-volume-allowed", {"podTemplate": _image_volume("registry.example.com/w:1")}, False),
    ("image-volume-elsewhere", {"podTemplate": _image_volume("evil.io/w:1")}, True),
    ("pod-priority", {"podTemplate": {"priorityClassName": "batch"}}, False),
    ("group-priority", {"schedulingPolicy": {"priorityClassName": "batch-low"}}, False),
    ("pod-priority-other", {"podTemplate": {"priorityClassName": "system-node-critical"}},
     True),
    ("group-priority-other", {"schedulingPolicy": {"priorityClassName": "urgent"}}, True),
    ("toleration-key-effect", {"podTemplate": {"tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]}},
     False),
    ("toleration-key-any-effect", {"podTemplate": {"tolerations": [
        {"key": "example.com/spot", "operator": "Exists"}]}}, False),
    ("toleration-other-effect", {"podTemplate": {"tolerations": [
        {"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]}}, True),
    ("toleration-every-effect", {"podTemplate": {"tolerations": [
        {"key": "dedicated", "operator": "Exists"}]}}, True),
    ("toleration-other-key", {"podTemplate": {"tolerations": [
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]}}, True),
    ("toleration-every-taint", {"podTemplate": {"tolerations": [{"operator": "Exists"}]}},
     True),
    ("volume-refused", {"podTemplate": {"volumes": [{"name": "c", "configMap": {"name": "x"}}]}},
     True),
]


def _admission_refuses(policy: dict[str, Any], job: dict[str, Any]) -> list[str]:
    """The validations of the rendered policy that `job` fails, as the API server runs them:
    the variables in order, then each validation (cel-python, not the operator's code)."""
    env = celpy.Environment()
    variables: dict[str, Any] = {}

    def run(expression: str) -> Any:
        activation = {"object": celpy.json_to_cel(job), "variables": celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()})}
        result = env.program(env.compile(expression)).evaluate(activation)
        if isinstance(result, Exception):
            raise result
        return result

    for variable in policy["spec"].get("variables", []):
        variables[variable["name"]] = run(variable["expression"])
    return [v["expression"] for v in policy["spec"]["validations"] if not run(v["expression"])]


def _operator_policy(objects: list[dict[str, Any]]) -> JobPolicy:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    # (the operator's namespace comes by the downward API, a valueFrom: not a policy's)
    return OperatorConfig.from_env({e["name"]: e["value"] for e in container["env"]
                                    if e["name"].startswith("CEPHALO_") and "value" in e}
                                   ).job_policy()


@pytest.fixture(scope="module")
def restricted() -> tuple[dict[str, Any], JobPolicy]:
    objects = render(RESTRICTED)
    return one(objects, "ValidatingAdmissionPolicy"), _operator_policy(objects)


@pytest.mark.parametrize(("fields", "refused"), [(f, r) for _, f, r in CASES],
                         ids=[what for what, _, _ in CASES])
def test_admission_and_operator_agree(restricted: tuple[dict[str, Any], JobPolicy],
                                      fields: dict[str, Any], refused: bool) -> None:
    policy, operator = restricted
    job = job_body("j", **{"image": "registry.example.com/ml/trainer:1", **fields})
    job["spec"] = {k: v for k, v in job["spec"].items() if v is not None}
    by_admission = _admission_refuses(policy, job)
    by_operator = refusal(CephaloJobSpec.model_validate(job["spec"]), operator)
    assert bool(by_admission) == refused, by_admission
    assert (by_operator is not None) == refused, by_operator


def test_unset_lists_restrict_nothing_new() -> None:
    """The default values: no image, PriorityClass or toleration rule is rendered or applied,
    so a job that ran before these lists existed still runs."""
    objects = render()
    policy = one(objects, "ValidatingAdmissionPolicy")
    names = {v["name"] for v in policy["spec"]["variables"]}
    assert not names & {"refusedImages", "refusedPriorityClasses", "refusedTolerations"}
    assert _operator_policy(objects) == JobPolicy()
    job = job_body("j", image="docker.io/anyone/trainer:1", podTemplate={
        "priorityClassName": "system-node-critical", "tolerations": [{"operator": "Exists"}]},
        schedulingPolicy={"priorityClassName": "urgent"})
    assert _admission_refuses(policy, job) == []
    assert refusal(CephaloJobSpec.model_validate(job["spec"]), JobPolicy()) is None


def test_the_operator_gets_the_lists_as_rendered() -> None:
    env = {e["name"]: e["value"] for e in one(render(RESTRICTED), "Deployment")["spec"][
        "template"]["spec"]["containers"][0]["env"] if "value" in e}
    assert env["CEPHALO_ALLOWED_IMAGE_PREFIXES"] == \
        "registry.example.com/,ghcr.io/cephalo/cephalo-trainer"
    assert env["CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES"] == "batch,batch-low"
    assert env["CEPHALO_ALLOWED_TOLERATIONS"] == "dedicated:NoSchedule,example.com/spot"
