"""Issue 12: plan on free GPUs of a shared cluster (real `kopf run` over HTTP, emulator with a
scheduler as strict as kube-scheduler: a pod whose GPUs do not fit stays Pending).

Two jobs that start at the same moment never plan the same GPU, and a GPU another team's
pod holds is planned by neither."""

from __future__ import annotations

import pytest
from kube_fixtures import job_body
from kubelet import WAIT_SECONDS, apply_job, finish_profilers, job_status, pods, wait_for
from shared_gpus_harness import NS, Cluster, cluster_fixture, plan_pools

pytestmark = pytest.mark.asyncio
__all__ = ["cluster_fixture"]
# Large enough that the planner (which may leave a GPU idle when it does not pay) uses every
# GPU it is given, so what each job takes is known.
BATCH = 4096


async def test_two_jobs_at_once_never_plan_the_same_gpus(cluster: Cluster) -> None:
    cluster.scheduler.resume()
    cluster.start_operator()
    bodies = [job_body(name, maxGpus=4, globalBatchSize=BATCH) for name in ("first", "second")]
    for body in bodies:  # back to back: both reconcile at the same moment
        await apply_job(cluster.api, body)
    for body in bodies:  # each profiles only the product it chose (the other's is taken)
        await finish_profilers(cluster.api, NS, body, count=1, timeout=WAIT_SECONDS)
    for body in bodies:
        name = body["metadata"]["name"]
        await wait_for(f"{name} Running", lambda n=name: job_status(
            cluster.api, NS, n).get("phase") == "Running", WAIT_SECONDS)
    chosen = sorted(tuple(plan_pools(job_status(cluster.api, NS, b["metadata"]["name"])).items())
                    for b in bodies)
    # spec.maxGpus 4 each: whoever came first took the 4 fast A10Gs, the other the 4 T4s
    assert chosen == [(("NVIDIA-A10G", 4),), (("Tesla-T4", 4),)], chosen
    cluster.assert_not_overcommitted()
    assert cluster.placed() == {"a10g-0": 2, "a10g-1": 2, "t4-0": 2, "t4-1": 2}
    for body in bodies:
        name = body["metadata"]["name"]
        assert not cluster.ever_unschedulable(name)
        assert all(p["spec"].get("nodeName") for p in pods(cluster.api, NS, "trainer", name))


async def test_gpus_held_by_other_pods_are_not_planned(cluster: Cluster) -> None:
    # Another team: 2 GPUs on a10g-0 asked as a limit only (the request follows from it), a
    # finished pod on t4-0 (holds nothing), and one on t4-1 in another namespace.
    await cluster.foreign_pod("hog", "a10g-0", limits=2)
    await cluster.foreign_pod("done", "t4-0", requests=2, phase="Succeeded")
    await cluster.foreign_pod("small", "t4-1", requests=1, limits=1, namespace="team-b")
    cluster.scheduler.resume()
    cluster.start_operator()
    body = job_body("shared", globalBatchSize=BATCH)
    await apply_job(cluster.api, body)
    await finish_profilers(cluster.api, NS, body, count=2, timeout=WAIT_SECONDS)
    status = await wait_for("Running", lambda: (
        s if (s := job_status(cluster.api, NS, "shared")).get("phase") == "Running" else None),
        WAIT_SECONDS)
    assert plan_pools(status) == {"NVIDIA-A10G": 2, "Tesla-T4": 3}
    cluster.assert_not_overcommitted()
    assert not cluster.ever_unschedulable("shared")
    placed = {p["spec"]["nodeName"] for p in pods(cluster.api, NS, "trainer", "shared")}
    assert "a10g-0" not in placed
