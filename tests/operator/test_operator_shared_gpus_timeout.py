"""Issue 12 without a gang scheduler: the pending timeout releases a half-placed gang and
re-plans on what is free; a tainted GPU node is used only with a matching toleration.

Real `kopf run` over HTTP against the emulator, whose scheduler is as strict as
kube-scheduler (GPU room, nodeSelector, taints): a rank that does not fit stays Pending with
PodScheduled=False, reason Unschedulable."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession
from kube_fixtures import job_body
from kubelet import (
    WAIT_SECONDS,
    apply_job,
    call,
    finish_profilers,
    job_status,
    pods,
    set_pod,
    wait_for,
)
from shared_gpus_harness import NS, Cluster, cluster_fixture, plan_pools

pytestmark = pytest.mark.asyncio
__all__ = ["cluster_fixture"]
# Large enough that the planner (which may leave a GPU idle when it does not pay) uses every
# GPU it is given, so what each job takes is known.
BATCH = 4096


def _events(cluster: Cluster, name: str) -> list[tuple[str, str]]:
    return [(e.get("reason"), e.get("message", "")) for e in cluster.api.list_objects("events", NS)
            if e.get("involvedObject", {}).get("name") == name]


async def test_pending_timeout_releases_the_gang_and_replans_on_free_gpus(
        cluster: Cluster) -> None:
    proc = cluster.start_operator()
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
    assert 'cephalo_operator_gang_releases_total{cephalo_job="gang",cephalo_namespace=' \
        '"default"} 1.0' in await _metrics(proc.metrics_port)


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


async def test_a_job_waiting_for_gpus_starts_when_another_job_lets_them_go(
        cluster: Cluster) -> None:
    cluster.scheduler.resume()
    # A re-check period far beyond this test's waits: only the wake-up on freed GPUs can
    # start the second job in time (before it existed, this test timed out).
    proc = cluster.start_operator(CEPHALO_RECHECK_SECONDS="600")
    first = job_body("first", globalBatchSize=BATCH)
    await apply_job(cluster.api, first)
    await finish_profilers(cluster.api, NS, first, count=2, timeout=WAIT_SECONDS)
    await wait_for("first Running", lambda: job_status(cluster.api, NS, "first").get(
        "phase") == "Running", WAIT_SECONDS)
    # Past the node view's first debounced wake-up round (node_debounce_seconds 1): no node
    # event is left to wake the second job by chance.
    await asyncio.sleep(2.0)
    await apply_job(cluster.api, job_body("second", globalBatchSize=BATCH))
    await wait_for("second waits for GPUs", lambda: _gpus_available(cluster, "second") == "False",
                   WAIT_SECONDS)
    for pod in pods(cluster.api, NS, "trainer", "first"):
        await set_pod(cluster.api, NS, pod["metadata"]["name"], "Succeeded")
    await wait_for("first Succeeded", lambda: job_status(cluster.api, NS, "first").get(
        "phase") == "Succeeded", WAIT_SECONDS)
    await wait_for("second finds GPUs", lambda: _gpus_available(cluster, "second") == "True",
                   WAIT_SECONDS)
    woken = [line for line in (await _metrics(proc.metrics_port)).splitlines()
             if line.startswith("cephalo_operator_freed_gpu_wakeups_total ")]
    assert woken and float(woken[0].split()[1]) >= 1, woken


async def _metrics(port: int) -> str:
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return await resp.text()


def _gpus_available(cluster: Cluster, name: str) -> str | None:
    for c in job_status(cluster.api, NS, name).get("conditions") or []:
        if c["type"] == "GpusAvailable":
            return str(c["status"])
    return None
