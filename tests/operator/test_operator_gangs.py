"""End to end: gang admission through Kueue (emulated as documented), Volcano and
scheduler-plugins coscheduling PodGroups, with the real kopf operator over HTTP.

Kueue's plain-pod behaviour is emulated in kueue_emulator.py (webhook gate, whole-group
admission against per-flavor GPU quota, release when the group finishes); the test plays
the kubelet, which never runs a gated pod (kubelet.set_pod refuses to).
"""

from __future__ import annotations

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import (
    JOBS,
    OperatorProcess,
    apply_job,
    call,
    finish_profilers,
    pods,
    set_pod,
    wait_for,
)
from kueue_emulator import GATE, KueueEmulation, gated
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    SMALL,
    operator_fixture,
    plan_of,
    start_operator_fixture,
    wait_phase,
)

from cephalo.operator.gang import POD_GROUP_APIS

pytestmark = pytest.mark.asyncio
QUEUE = {"kueue.x-k8s.io/queue-name": "team-a"}
L4, A6000 = "NVIDIA-L4", "NVIDIA-RTX-A6000"
# A batch large enough that the planner uses every selected GPU (2 x L4 + 1 x A6000): a gang
# of several pools, so all-or-nothing admission is visible.
BIG = {**SMALL, "globalBatchSize": 1024}


def _labelled(name: str, labels: dict[str, str], **spec) -> dict:
    body = job_body(name, **{**BIG, **spec})
    body["metadata"]["labels"] = labels
    return body


def _ranks(api: ApiEmulator, name: str, attempt: str) -> list[dict]:
    return sorted((p for p in pods(api, NS, "trainer", name)
                   if p["metadata"]["labels"].get("cephalo.dev/attempt") == attempt
                   and not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


async def _profile_under_kueue(api: ApiEmulator, body: dict, count: int) -> None:
    """Profilers are single plain pods for Kueue: each admitted alone, then run."""
    name = body["metadata"]["name"]
    await wait_for("admitted profilers", lambda: (
        len(ps := pods(api, NS, "profiler", name)) >= count and not any(gated(p) for p in ps)))
    await finish_profilers(api, NS, body, count=count)


def _needs(plan) -> dict[str, int]:
    """GPUs per flavor (pool) the plan's gang asks Kueue for."""
    needs: dict[str, int] = {}
    for rank in plan.ranks:
        needs[rank.pool] = needs.get(rank.pool, 0) + 1
    return needs


async def test_kueue_admits_the_gang_as_one_unit_and_releases_quota(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    kueue = KueueEmulation(emulator, quota={L4: 1, A6000: 1}).install()
    # Profiled up to the global batch: the plan needs no extra profiler pass (issue 46
    # item 3), which the Hold below would keep gated as Kueue does.
    body = _labelled("kj", QUEUE, backoffLimit=0, planner={
        "chooseGpus": False, "profileMicroBatchSizes": [2**i for i in range(11)]})
    await apply_job(emulator, body)
    profilers = await wait_for("profilers", lambda: pods(emulator, NS, "profiler", "kj"))
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and
               "kueue.x-k8s.io/pod-group-name" not in p["metadata"]["labels"]
               for p in profilers)
    await wait_for("admitted profilers", lambda: (
        len(ps := pods(emulator, NS, "profiler", "kj")) >= 2 and not any(gated(p) for p in ps)))
    kueue.set_hold(True)  # stopPolicy: Hold while the gang arrives (no race with admission)
    await finish_profilers(emulator, NS, body, count=2)
    plan = await wait_for("a plan", lambda: plan_of(emulator, "kj"))
    needs, size = _needs(plan), plan.world_size
    assert size >= 2 and len(needs) == 2, "the test wants a gang over two pools"
    ranks = await wait_for(f"{size} rank pods", lambda: (
        rs if len(rs := _ranks(emulator, "kj", "0")) == size else None))
    group = ranks[0]["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"]
    for pod in ranks:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == group
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == \
            str(size)
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/retriable-in-group"] == "false"
        assert pod["spec"]["schedulingGates"] == [{"name": GATE}]
        assert pod["metadata"]["finalizers"] == ["kueue.x-k8s.io/managed"]
        assert pod["status"]["conditions"][0]["reason"] == "SchedulingGated"
    # One GPU short on the biggest pool: no rank is admitted, not even those that would fit.
    short = max(needs, key=lambda f: needs[f])
    kueue.quota.clear()
    kueue.quota.update({**needs, short: needs[short] - 1})
    kueue.set_hold(False)
    assert (NS, group) not in kueue.admitted and all(
        gated(p) for p in _ranks(emulator, "kj", "0"))
    with pytest.raises(AssertionError, match="scheduling gates"):
        await set_pod(emulator, NS, ranks[0]["metadata"]["name"], "Running")
    status = await wait_phase(emulator, "kj", "Pending")
    assert status["message"].startswith("waiting for ranks: 0/")  # queued, not failed
    assert all(gated(p) for p in _ranks(emulator, "kj", "0"))
    kueue.set_quota(short, needs[short])  # the administrator raises the ClusterQueue quota
    ranks = _ranks(emulator, "kj", "0")
    assert not any(gated(p) for p in ranks)  # the whole group un-gated at once
    assert kueue.usage() == needs
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Running")
    await wait_phase(emulator, "kj", "Running")

    # Suspend: every pod deleted, so the Workload goes and its quota is free; resume: the
    # same attempt's group queues again and is admitted as one unit again.
    await call(emulator, "PATCH", JOBS.format(ns=NS) + "/kj", {"spec": {"suspend": True}})
    await wait_phase(emulator, "kj", "Suspended")
    await wait_for("pods gone and quota free", lambda: not pods(
        emulator, NS, "trainer", "kj") and kueue.usage() == {})
    await call(emulator, "PATCH", JOBS.format(ns=NS) + "/kj", {"spec": {"suspend": False}})
    ranks = await wait_for("re-admitted ranks", lambda: (
        rs if len(rs := _ranks(emulator, "kj", "0")) == size
        and not any(gated(p) for p in rs) else None))
    assert kueue.admissions.count((NS, group)) == 2
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Running")
    await wait_phase(emulator, "kj", "Running")

    # Terminal failure (backoffLimit 0): the failed rank is kept for its logs, so Kueue
    # would hold the quota for a replacement; retriable-in-group=false (on every rank pod
    # since its creation) ends the group once every pod is terminated.
    await set_pod(emulator, NS, ranks[-1]["metadata"]["name"], "Failed", exit_code=1,
                  message="RuntimeError: CUDA error: an illegal memory access")
    await wait_phase(emulator, "kj", "Failed")
    await wait_for("quota released", lambda: kueue.usage() == {})
    kept = pods(emulator, NS, "trainer", "kj")
    assert kept and all(p["metadata"]["annotations"]["kueue.x-k8s.io/retriable-in-group"]
                        == "false" for p in kept)
    assert kueue.finished.count((NS, group)) == 2  # suspended once, failed once


async def test_kueue_gang_restart_is_a_new_group(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    kueue = KueueEmulation(emulator, quota={L4: 2, A6000: 1}).install()
    body = _labelled("kr", QUEUE, backoffLimit=1)
    await apply_job(emulator, body)
    await _profile_under_kueue(emulator, body, 2)
    size = (await wait_for("a plan", lambda: plan_of(emulator, "kr"))).world_size
    first = await wait_for("admitted ranks", lambda: (
        rs if len(rs := _ranks(emulator, "kr", "0")) == size
        and not any(gated(p) for p in rs) else None))
    old = first[0]["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"]
    for pod in first:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Running")
    await set_pod(emulator, NS, first[-1]["metadata"]["name"], "Failed", exit_code=1)
    # The old group's pods are deleted (its Workload goes, quota freed); the new attempt's
    # pods form a new group that fits in the same quota only because the old one left.
    second = await wait_for("the restarted gang admitted", lambda: (
        rs if len(rs := _ranks(emulator, "kr", "1")) == size
        and not any(gated(p) for p in rs) else None))
    new = second[0]["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"]
    # The old pods were held by Kueue's finalizer until their Workload finished (all
    # terminated, retriable-in-group=false): without that, the restart would deadlock.
    assert new != old and (NS, old) in kueue.finished
    assert [w for w in kueue.admissions if w[1] in (old, new)] == [(NS, old), (NS, new)]


def _pod_groups(api: ApiEmulator, which: str) -> list[dict]:
    group = POD_GROUP_APIS[which].group
    return api.list_objects("podgroups", NS, group=group)


def _declare_pod_groups(api: ApiEmulator) -> None:
    for pg_api in POD_GROUP_APIS.values():  # what installing each scheduler's CRD does
        api.add_resource(pg_api.group, pg_api.version, pg_api.plural, pg_api.kind)


async def test_volcano_pod_group_precedes_ranks_and_follows_attempts(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    _declare_pod_groups(emulator)
    body = job_body("vj", backoffLimit=2, **BIG, schedulingPolicy={
        "schedulerName": "volcano", "queue": "research", "priorityClassName": "high"})
    await apply_job(emulator, body)
    profilers = await wait_for("profilers", lambda: pods(emulator, NS, "profiler", "vj"))
    assert {p["spec"]["schedulerName"] for p in profilers} == {"volcano"}
    await finish_profilers(emulator, NS, body, count=2)
    plan = await wait_for("a plan", lambda: plan_of(emulator, "vj"))
    ranks = await wait_for("rank pods", lambda: (
        rs if len(rs := _ranks(emulator, "vj", "0")) == plan.world_size else None))
    (pod_group,) = _pod_groups(emulator, "volcano")
    job_uid = next(j for j in emulator.list_objects("cephalojobs", NS, group="cephalo.dev")
                   )["metadata"]["uid"]
    assert pod_group["metadata"]["ownerReferences"][0]["uid"] == job_uid
    assert pod_group["spec"]["minMember"] == plan.world_size
    assert pod_group["spec"]["minTaskMember"] == {
        pool.lower(): n for pool, n in sorted(_needs(plan).items())}
    assert pod_group["spec"]["queue"] == "research"
    assert pod_group["spec"]["priorityClassName"] == "high"
    for pod in ranks:
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["spec"]["priorityClassName"] == "high"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == \
            pod_group["metadata"]["name"]
    creates = [c for c in emulator.calls if c.verb == "create" and c.committed and (
        c.resource == "podgroups" or (c.resource == "pods" and "-rank-" in (c.name or "")))]
    assert creates[0].resource == "podgroups"  # the PodGroup exists before any rank pod
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Running")
    await set_pod(emulator, NS, ranks[0]["metadata"]["name"], "Failed", exit_code=1)
    second = await wait_for("the restarted gang's PodGroup", lambda: (
        pgs if len(pgs := _pod_groups(emulator, "volcano")) == 1
        and pgs[0]["metadata"]["name"] != pod_group["metadata"]["name"] else None))
    assert second[0]["metadata"]["name"].startswith("vj-g1-")
    again = await wait_for("restarted ranks", lambda: (
        rs if len(rs := _ranks(emulator, "vj", "1")) == plan.world_size else None))
    assert {p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] for p in again} == \
        {second[0]["metadata"]["name"]}
    assert emulator.created("podgroups", group="scheduling.volcano.sh")[
        (NS, second[0]["metadata"]["name"])] == 1
    await call(emulator, "PATCH", JOBS.format(ns=NS) + "/vj", {"spec": {"suspend": True}})
    await wait_for("PodGroups gone on suspend", lambda: not _pod_groups(emulator, "volcano"))


async def test_coscheduling_pod_group_and_job_network_policy(
        emulator: ApiEmulator, start_operator) -> None:
    start_operator(CEPHALO_JOB_NETWORK_POLICIES="true")  # the chart's networkPolicy.enabled
    _declare_pod_groups(emulator)
    body = job_body("cj", **BIG, schedulingPolicy={
        "schedulerName": "scheduler-plugins-scheduler", "scheduleTimeoutSeconds": 60})
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    plan = await wait_for("a plan", lambda: plan_of(emulator, "cj"))
    ranks = await wait_for("rank pods", lambda: (
        rs if len(rs := _ranks(emulator, "cj", "0")) == plan.world_size else None))
    (pod_group,) = _pod_groups(emulator, "scheduler-plugins")
    assert pod_group["spec"] == {"minMember": plan.world_size, "scheduleTimeoutSeconds": 60}
    assert {p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] for p in ranks} == \
        {pod_group["metadata"]["name"]}
    assert {p["spec"]["schedulerName"] for p in ranks} == {"scheduler-plugins-scheduler"}
    assert not _pod_groups(emulator, "volcano")
    (policy,) = emulator.list_objects("networkpolicies", NS, group="networking.k8s.io")
    assert policy["metadata"]["name"] == "cj-ranks"
    assert policy["metadata"]["ownerReferences"][0]["name"] == "cj"
    ranks_only = {"cephalo.dev/job": "cj", "cephalo.dev/role": "trainer"}
    assert policy["spec"]["podSelector"]["matchLabels"] == ranks_only
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": ranks_only}}]}]
    assert all(ranks_only.items() <= p["metadata"]["labels"].items() for p in ranks)
