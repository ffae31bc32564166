"""Issue 39 item 2: a foreign pod placed within the operator's pod-list window is not planned
on. One pod LIST serves the passes of a recheck period; a job created seconds after another
team's pod started on some GPUs was planned onto them (its ranks there stayed Pending until
the pending timeout). Real `kopf run` against the emulator with a strict scheduler; the
recheck period is a minute, so the shared LIST is certainly from before the foreign pod."""

from __future__ import annotations

import pytest
from kube_fixtures import job_body
from kubelet import WAIT_SECONDS, apply_job, finish_profilers, job_status, wait_for
from shared_gpus_harness import NS, Cluster, cluster_fixture, plan_pools

pytestmark = pytest.mark.asyncio
__all__ = ["cluster_fixture"]
BATCH = 4096  # every GPU given pays (see test_operator_shared_gpus)


async def test_a_pod_placed_since_the_last_list_is_not_planned_on(cluster: Cluster) -> None:
    cluster.scheduler.resume()
    cluster.start_operator(CEPHALO_RECHECK_SECONDS="60")
    # A job that only looks: no L4 here, it waits, and its pass made the shared pod LIST.
    await apply_job(cluster.api, job_body("waiting", gpuPools=[{"product": "NVIDIA-L4"}]))
    await wait_for("waiting for GPUs", lambda: str(job_status(cluster.api, NS, "waiting").get(
        "message", "")).startswith("waiting for GPUs"))
    await cluster.foreign_pod("hog", "a10g-0", requests=2, limits=2)  # after that LIST
    body = job_body("late", globalBatchSize=BATCH, gpuPools=[{"product": "NVIDIA-A10G"}])
    await apply_job(cluster.api, body)
    await finish_profilers(cluster.api, NS, body, count=1, timeout=WAIT_SECONDS)
    status = await wait_for("late planned", lambda: (
        s if plan_pools(s := job_status(cluster.api, NS, "late")) else None), WAIT_SECONDS)
    assert plan_pools(status) == {"NVIDIA-A10G": 2}, status.get("message")
    await wait_for("late Running", lambda: job_status(cluster.api, NS, "late").get(
        "phase") == "Running", WAIT_SECONDS)
    cluster.assert_not_overcommitted()
    assert not cluster.ever_unschedulable("late")
