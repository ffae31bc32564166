"""Issue 12 without a gang scheduler: the pending timeout releases a half-placed gang and
re-plans on what is free; a tainted GPU node is used only with a matching toleration.

Real `kopf run` over HTTP against the emulator, whose scheduler is as strict as
kube-scheduler (GPU room, nodeSelector, taints): a rank that does not fit stays Pending with
PodScheduled=False, reason Unschedulable."""

from __future__ import annotations

import pytest
from kube_fixtures import job_body
from kubelet import apply_job, call, finish_profilers, job_status, pods, set_pod, wait_for
from shared_gpus_harness import NS, Cluster, cluster_fixture, plan_pools

pytestmark = pytest.mark.asyncio
__all__ = ["cluster_fixture"]
WAIT_SECONDS = 60.0
# Large enough that the planner (which may leave a GPU idle when it does not pay) uses every
# GPU it is given, so what each job takes is known.
BATCH = 4096


def _events(cluster: Cluster, name: str) -> list[tuple[str, str]]:
    return [(e.get("reason"), e.get("message", "")) for e in cluster.api.list_objects("events", NS)
            if e.get("involvedObject", {}).get("name") == name]


async def test_pending_timeout_releases_the_gang_and_replans_on_free_gpus(
        cluster: Cluster) -> None:
    cluster.start_operator()
    body = job_body("gang", globalBatchSize=BATCH, schedulingPolicy={"scheduleTimeoutSeconds": 2})
    await apply_job(cluster.api, body)
    await finish_profilers(cluster.api, NS, body, count=2, timeout=WAIT_SECONDS)
    first = await wait_for("8 rank pods", lambda: (
        ps if len(ps := pods(cluster.api, NS, "trainer", "gang")) == 8 else None), WAIT_SECONDS)
    # Between the plan and the placement another team's pod takes a T4: one rank cannot fit.
    await cluster.foreign_pod("late", "t4-1", requests=1)
    cluster.scheduler.resume()
    await wait_for("GangReleased", lambda: any(r == "GangReleased" for r, _ in _events(
        cluster, "gang")), WAIT_SECONDS)
    stuck = cluster.ever_unschedulable("gang")
    assert len(stuck) == 1, stuck
    (message,) = [m for r, m in _events(cluster, "gang") if r == "GangReleased"]
    assert "scheduleTimeoutSeconds 2" in message and "Insufficient nvidia.com/gpu" in message
    status = await wait_for("Running again", lambda: (
        s if (s := job_status(cluster.api, NS, "gang")).get("phase") == "Running" else None),
        WAIT_SECONDS)
    # Re-planned on the 7 free GPUs; the first gang's pods (running ones too) are gone.
    assert plan_pools(status) == {"NVIDIA-A10G": 4, "Tesla-T4": 3}
    ranks = pods(cluster.api, NS, "trainer", "gang")
    assert len(ranks) == 7 and all(p["spec"].get("nodeName") for p in ranks)
    assert not {p["metadata"]["uid"] for p in first} & {p["metadata"]["uid"] for p in ranks}
    assert not status.get("restarts") and not status.get("preemptions")  # not a failure
    scheduled = [c for c in status["conditions"] if c["type"] == "RanksScheduled"]
    assert scheduled and scheduled[0]["status"] == "True"
    cluster.assert_not_overcommitted()


async def test_tainted_gpu_nodes_only_with_a_matching_toleration(cluster: Cluster) -> None:
    for node in ("t4-0", "t4-1"):
        await call(cluster.api, "PATCH", f"/api/v1/nodes/{node}", {"spec": {"taints": [
            {"key": "team", "value": "ml", "effect": "NoSchedule"}]}})
    cluster.scheduler.resume()
    cluster.start_operator()
    plain = job_body("plain", globalBatchSize=BATCH)
    await apply_job(cluster.api, plain)
    await finish_profilers(cluster.api, NS, plain, count=1, timeout=WAIT_SECONDS)
    status = await wait_for("plain Running", lambda: (
        s if (s := job_status(cluster.api, NS, "plain")).get("phase") == "Running" else None),
        WAIT_SECONDS)
    assert plan_pools(status) == {"NVIDIA-A10G": 4}
    for pod in pods(cluster.api, NS, "trainer", "plain"):
        await set_pod(cluster.api, NS, pod["metadata"]["name"], "Succeeded")
    await wait_for("plain Succeeded", lambda: job_status(
        cluster.api, NS, "plain").get("phase") == "Succeeded", WAIT_SECONDS)
    tolerant = job_body("tolerant", globalBatchSize=BATCH, podTemplate={"tolerations": [
        {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]})
    await apply_job(cluster.api, tolerant)
    await finish_profilers(cluster.api, NS, tolerant, count=1, timeout=WAIT_SECONDS)  # T4 only
    status = await wait_for("tolerant Running", lambda: (
        s if (s := job_status(cluster.api, NS, "tolerant")).get("phase") == "Running" else None),
        WAIT_SECONDS)
    assert plan_pools(status) == {"NVIDIA-A10G": 4, "Tesla-T4": 4}
    assert not cluster.ever_unschedulable("tolerant")
    assert {p["spec"]["nodeName"] for p in pods(cluster.api, NS, "trainer", "tolerant")} == {
        "a10g-0", "a10g-1", "t4-0", "t4-1"}
