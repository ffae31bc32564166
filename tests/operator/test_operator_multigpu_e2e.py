"""Issue 12, item 5, end to end: the real `kopf run` operator over HTTP against the emulator,
whose scheduler places a pod only on a node with room for all the GPUs it requests (as
kube-scheduler's NodeResourcesFit does).

A job with `ranksPerPod: 0` (auto) on a node of 4 A10Gs and a node of 2 T4s runs as two
pods, 4 ranks and 2 ranks, each on its node; the job reaches Running, and a failure of the
4-rank pod restarts the whole gang (both pods, a new attempt).
"""

from __future__ import annotations

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    WAIT_SECONDS,
    apply_job,
    apply_nodes,
    call,
    finish_profilers,
    job_status,
    pods,
    set_pod,
    wait_for,
)
from operator_harness import NS, events, plan_of
from shared_gpus_harness import Cluster, cluster_fixture

from cephalo.api.trainer_env import pod_process_environ, read_env
from cephalo.operator.podspec import pod_groups

pytestmark = pytest.mark.asyncio
__all__ = ["cluster_fixture"]
GPU = "nvidia.com/gpu"


@pytest.fixture(name="nodes", autouse=True)
def nodes_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """One node of 4 A10Gs, one of 2 T4s (instead of the shared cluster's 2-GPU nodes)."""
    import shared_gpus_harness

    monkeypatch.setattr(shared_gpus_harness, "shared_cluster", lambda: [
        gpu_node("a10g-0", "NVIDIA-A10G", 4, 23028), gpu_node("t4-0", "Tesla-T4", 2, 15360),
        gpu_node("cpu-0", None, 0)])


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]
               if "value" in e}


def _running(api: ApiEmulator, attempt: int):
    return lambda: (s if (s := job_status(api, NS, "multi")).get("phase") == "Running"
                    and int(s.get("restarts") or 0) == attempt else None)


async def test_a_node_of_four_gpus_runs_one_pod_of_four_ranks(
        emulator: ApiEmulator, cluster: Cluster) -> None:
    cluster.scheduler.resume()
    cluster.start_operator()
    # A batch large enough that the planner uses every GPU it is given.
    body = job_body("multi", ranksPerPod=0, globalBatchSize=4096, backoffLimit=2)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2, timeout=WAIT_SECONDS)
    status = await wait_for("Running", _running(emulator, 0), WAIT_SECONDS)
    plan = plan_of(emulator, "multi")
    assert plan.world_size == 6 and status["plan"]["worldSize"] == 6
    assert [[r.rank for r in g] for g in pod_groups(plan)] == [[0, 1, 2, 3], [4, 5]]
    ranks = sorted(pods(emulator, NS, "trainer", "multi"), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"] for p in ranks] == ["multi-rank-0", "multi-rank-4"]
    for pod, (node, first, count) in zip(ranks, [("a10g-0", 0, 4), ("t4-0", 4, 2)],
                                         strict=True):
        assert pod["spec"]["nodeName"] == node  # the scheduler found room for all k GPUs
        assert pod["spec"]["containers"][0]["resources"]["requests"][GPU] == count
        env = _env(pod)
        pod_vars = read_env(env)
        assert (pod_vars.rank, pod_vars.ranks_per_pod, pod_vars.world_size) == (first, count, 6)
        assert env["MASTER_ADDR"].startswith("multi-rank-0.multi.")
        processes = [read_env(pod_process_environ(env, i)) for i in range(count)]
        assert [(p.rank, p.local_rank) for p in processes] == [(first + i, i)
                                                              for i in range(count)]
        assert all(p.ranks_per_pod is None for p in processes)
    cluster.assert_not_overcommitted()
    assert cluster.placed() == {"a10g-0": 4, "t4-0": 2}
    assert "6 ranks running" in status["message"]

    # The 4-rank pod fails: every rank restarts (both pods, the next attempt).
    await set_pod(emulator, NS, "multi-rank-0", "Failed", exit_code=1,
                  message="RuntimeError: CUDA error: an illegal memory access was encountered")
    status = await wait_for("Running again", _running(emulator, 1), WAIT_SECONDS)
    again = sorted(pods(emulator, NS, "trainer", "multi"), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"] for p in again] == ["multi-rank-0", "multi-rank-4"]
    assert {p["metadata"]["labels"]["cephalo.dev/attempt"] for p in again} == {"1"}
    assert [_env(p)["CEPHALO_RESTART_ATTEMPT"] for p in again] == ["1", "1"]
    assert cluster.placed() == {"a10g-0": 4, "t4-0": 2}
    await wait_for("GangRestart event", lambda: any(
        r == "GangRestart" for _, r, _ in events(emulator, "multi")))
    message = next(m for _, r, m in events(emulator, "multi") if r == "GangRestart")
    assert "multi-rank-0" in message and "illegal memory access" in message


async def test_pods_are_regrouped_when_their_node_is_replaced_by_smaller_ones(
        emulator: ApiEmulator, cluster: Cluster) -> None:
    """The 4-GPU node goes and two 2-GPU nodes of the pool come: as many A10Gs, but the pod
    of 4 ranks fits on no node, so the job re-plans into pods of 2 (not a Pending pod)."""
    cluster.scheduler.resume()
    cluster.start_operator()
    body = job_body("multi", ranksPerPod=0, globalBatchSize=4096)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2, timeout=WAIT_SECONDS)
    await wait_for("Running", _running(emulator, 0), WAIT_SECONDS)
    assert [len(g) for g in pod_groups(plan_of(emulator, "multi"))] == [4, 2]
    await apply_nodes(emulator, [gpu_node("a10g-1", "NVIDIA-A10G", 2, 23028),
                                 gpu_node("a10g-2", "NVIDIA-A10G", 2, 23028)])
    await call(emulator, "DELETE", "/api/v1/nodes/a10g-0")
    await wait_for("a plan of 2-rank pods", lambda: (
        p if (p := plan_of(emulator, "multi")) is not None
        and [len(g) for g in pod_groups(p)] == [2, 2, 2] else None), WAIT_SECONDS)
    await wait_for("Running on the new nodes", lambda: (
        job_status(emulator, NS, "multi").get("phase") == "Running" and sorted(
            (p["spec"].get("nodeName"), p["metadata"]["name"])
            for p in pods(emulator, NS, "trainer", "multi")) == [
            ("a10g-1", "multi-rank-0"), ("a10g-2", "multi-rank-2"), ("t4-0", "multi-rank-4")]),
        WAIT_SECONDS)
    assert any(r == "Replanning" and "fits on no node" in m
               for _, r, m in events(emulator, "multi"))
