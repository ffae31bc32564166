"""Gang admission, pure: which scheduler, the pods' keys and the PodGroups (golden files).

Pods are validated with kubernetes-validate; the PodGroup CRDs are not in it, so their shape
is checked against the fields Volcano's PodGroupSpec (scheduling.volcano.sh/v1beta1) and
scheduler-plugins' PodGroupSpec (scheduling.x-k8s.io/v1alpha1) define.
Regenerate golden files only on purpose: CEPHALO_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import pytest
from kube_fixtures import job_body
from test_operator_render import UID, _check_golden, _plan, _validate

from cephalo.api import JobFileError, parse_job
from cephalo.operator.gang import (
    gang_scheduler,
    group_name,
    pod_group_api,
    render_pod_group,
)
from cephalo.operator.render import config_hash, owner_reference, render, render_profiler_pod

# PodGroupSpec fields and their JSON types, as each project's Go types define them.
VOLCANO_SPEC = {"minMember": int, "minTaskMember": dict, "queue": str,
                "priorityClassName": str, "minResources": dict}
COSCHEDULING_SPEC = {"minMember": int, "minResources": dict, "scheduleTimeoutSeconds": int}


def _job(labels: dict[str, str] | None = None, **spec):
    body = job_body("gpt", uid=UID, **spec)
    if labels:
        body["metadata"]["labels"] = labels
    return parse_job(body)


def _pod_group(job, attempt: int = 0):
    plan = _plan()
    pods = render(job, plan, attempt=attempt)[2:]
    group = group_name("gpt", attempt, config_hash(job, plan))
    return pods, render_pod_group(job, pods, group=group, owner=owner_reference(job))


def _check_shape(pod_group: dict, fields: dict[str, type]) -> None:
    assert set(pod_group) == {"apiVersion", "kind", "metadata", "spec"}
    for key, value in pod_group["spec"].items():
        assert key in fields, f"{key} is not a PodGroupSpec field"
        assert isinstance(value, fields[key]), (key, value)
    ref = pod_group["metadata"]["ownerReferences"][0]
    assert ref["uid"] == UID and ref["controller"] is True and ref["kind"] == "CephaloJob"


@pytest.mark.parametrize(("labels", "policy", "expected"), [
    (None, None, "none"),
    ({"kueue.x-k8s.io/queue-name": "team-a"}, None, "kueue"),
    ({"kueue.x-k8s.io/queue-name": "team-a"}, {"schedulerName": "volcano"}, "kueue"),
    (None, {"schedulerName": "volcano"}, "volcano"),
    (None, {"schedulerName": "scheduler-plugins-scheduler"}, "scheduler-plugins"),
    (None, {"schedulerName": "my-sched", "gangScheduler": "scheduler-plugins"},
     "scheduler-plugins"),
    (None, {"schedulerName": "my-sched"}, "none"),
    (None, {"scheduleTimeoutSeconds": 600}, "none"),
])
def test_gang_scheduler_choice(labels, policy, expected) -> None:
    spec = {"schedulingPolicy": policy} if policy else {}
    assert gang_scheduler(_job(labels, **spec)) == expected


def test_unknown_gang_scheduler_is_refused() -> None:
    with pytest.raises(JobFileError, match="gangScheduler"):
        _job(schedulingPolicy={"gangScheduler": "yunikorn"})


def test_kueue_rank_pods_form_one_group_per_attempt_golden() -> None:
    job = _job({"kueue.x-k8s.io/queue-name": "team-a"})
    plan = _plan()
    pods = render(job, plan, attempt=0)[2:]
    group = group_name("gpt", 0, config_hash(job, plan))
    for pod in pods:  # consistent on every member, as Kueue requires
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == group
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
        # Each attempt is a new group, never retried in place: Kueue may finish it (and
        # free its quota) once all its pods are terminated.
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/retriable-in-group"] == "false"
        assert "schedulerName" not in pod["spec"]  # Kueue admits; the default scheduler places
    again = render(job, plan, attempt=1)[2]
    assert again["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == \
        group_name("gpt", 1, config_hash(job, plan)) != group
    assert pod_group_api(job) is None  # Kueue needs no PodGroup object
    assert len(group) <= 63 and len(group_name("x" * 47, 9999, "f" * 16)) <= 63
    profiler = render_profiler_pod(job, "NVIDIA-L4", 0)
    labels = profiler["metadata"]["labels"]
    # A profiler is a single plain pod for Kueue: queue label only, no group.
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io/pod-group-name" not in labels
    _validate([pods[0], profiler])
    _check_golden("gang-kueue.yaml", [pods[0], profiler])


def test_volcano_pod_group_and_pods_golden() -> None:
    job = _job(schedulingPolicy={"schedulerName": "volcano", "queue": "research",
                                 "priorityClassName": "training-high"},
               podTemplate={"resources": {"requests": {"cpu": "500m", "memory": "4Gi"}},
                            "priorityClassName": "ignored-by-policy"})
    pods, pod_group = _pod_group(job)
    assert pod_group is not None
    _check_shape(pod_group, VOLCANO_SPEC)
    assert pod_group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    spec = pod_group["spec"]
    assert spec["minMember"] == 3 and sum(spec["minTaskMember"].values()) == 3
    assert spec["minTaskMember"] == {"nvidia-l4": 2, "nvidia-rtx-a6000": 1}
    assert spec["queue"] == "research" and spec["priorityClassName"] == "training-high"
    assert spec["minResources"] == {"cpu": "1500m", "memory": str(3 * 4 * 2**30),
                                    "nvidia.com/gpu": "3"}
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["spec"]["priorityClassName"] == "training-high"
        annotations = pod["metadata"]["annotations"]
        assert annotations["scheduling.k8s.io/group-name"] == pod_group["metadata"]["name"]
        assert annotations["volcano.sh/task-spec"] == pod["metadata"]["labels"][
            "cephalo.dev/gpu-product"]
    profiler = render_profiler_pod(job, "NVIDIA-L4", 0)
    assert profiler["spec"]["schedulerName"] == "volcano"
    assert "scheduling.k8s.io/group-name" not in (profiler["metadata"].get("annotations") or {})
    _validate([pods[0], profiler])
    _check_golden("gang-volcano.yaml", [pod_group, pods[0]])


def test_coscheduling_pod_group_and_pods_golden() -> None:
    job = _job(schedulingPolicy={"schedulerName": "scheduler-plugins-scheduler",
                                 "scheduleTimeoutSeconds": 120})
    pods, pod_group = _pod_group(job)
    assert pod_group is not None
    _check_shape(pod_group, COSCHEDULING_SPEC)
    assert pod_group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert pod_group["spec"] == {"minMember": 3, "scheduleTimeoutSeconds": 120}
    for pod in pods:
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == \
            pod_group["metadata"]["name"]
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    _validate(pods)
    _check_golden("gang-coscheduling.yaml", [pod_group, pods[0]])


def test_plain_job_renders_no_gang_keys() -> None:
    job = _job()
    pods, pod_group = _pod_group(job)
    assert pod_group is None
    for pod in pods:
        assert "schedulerName" not in pod["spec"]
        assert not any(k.startswith(("kueue.", "scheduling.")) for k in
                       {**pod["metadata"]["labels"], **pod["metadata"]["annotations"]})
