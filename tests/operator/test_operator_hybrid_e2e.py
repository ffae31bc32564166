"""Issue 44, "the operator end to end" on the emulator: a job on two nodes of two GPUs whose
NICs the cluster labels slow (cephalo.dev/nic-gbps = 1) is planned hybrid (one replica group
per node), its two rank pods (one per node, `ranksPerPod: 0`) read the groups from the plan
ConfigMap's plan.json, and it trains to Succeeded.

Real trainers (process_kubelet.py: each pod's `python -m cephalo.trainer` launches its two
ranks, CPU, gloo) under the real kopf operator process and the API emulator. That the ranks
trained hybrid, not flat, is read from what they wrote: the checkpoint's meta.json names the
replica groups the engine ran (docs/hybrid-sharding.md); every rank writes its piece."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node
from kubelet import (
    WAIT_SECONDS,
    Scheduler,
    apply_job,
    apply_nodes,
    job_status,
    pods,
    set_pod,
    wait_for,
)
from operator_harness import NS, events, plan_of
from process_kubelet import ProcessKubelet, trainers_and_operator
from test_operator_elastic_e2e import POOL, _job, _profile

from cephalo.api.network import NIC_GBPS_LABEL

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # real trainer processes
STEPS = 6
# The tiny model: across so slow a NIC flat sharding's gathers cost clearly more (above the
# planner's 5 % margin for hybrid) than the cross-group halves.
SLOW_NIC_GBPS = "0.01"


@pytest_asyncio.fixture(name="cluster")
async def cluster_fixture(emulator: ApiEmulator,
                          tmp_path: Path) -> AsyncIterator[tuple[ApiEmulator, ProcessKubelet]]:
    nodes = [gpu_node(f"a10g-{i}", POOL, 2, 23028) for i in range(2)]
    for node in nodes:
        node["metadata"]["labels"][NIC_GBPS_LABEL] = SLOW_NIC_GBPS
    await apply_nodes(emulator, [*nodes, gpu_node("cpu-0", None, 0)])
    Scheduler(emulator, run=False)
    async with trainers_and_operator(emulator, tmp_path, {"hy"}, _profile, {
            "CEPHALO_PROGRESS_INTERVAL_SECONDS": "0.3"}) as kubelet:
        yield emulator, kubelet


async def test_a_job_behind_a_slow_link_trains_hybrid_to_succeeded(cluster) -> None:
    api, kubelet = cluster
    body = _job("hy", STEPS, ranksPerPod=0)
    body["spec"]["planner"]["sharding"] = "auto"
    await apply_job(api, body)
    profiler = await wait_for("the profiler pod", lambda: pods(api, NS, "profiler", "hy"))
    await set_pod(api, NS, profiler[0]["metadata"]["name"], "Succeeded",
                  message=_profile(profiler[0], body))
    status = await wait_for("hy finished", lambda: (
        s if (s := job_status(api, NS, "hy")).get("phase") in ("Succeeded", "Failed")
        else None), WAIT_SECONDS * 2)
    assert status["phase"] == "Succeeded", status.get("message")

    # Planned hybrid: a replica group per node, in the ConfigMap the ranks read.
    plan = plan_of(api, "hy")
    assert plan is not None and plan.replica_groups == [[0, 1], [2, 3]], plan
    assert plan.pod_ranks == [2, 2] and plan.assumptions["sharding"] == "hybrid"
    assert (status["plan"]["replicaGroups"], status["plan"]["replicaGroupSize"]) == (2, 2)
    planned = next(m for _, r, m in events(api, "hy") if r == "Planned")
    assert "hybrid: 2 replica groups of 2" in planned, planned

    # Each pod (one per node) was given that plan.json and ran its two ranks on it.
    rank_pods = sorted(pods(api, NS, "trainer", "hy"), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"] for p in rank_pods] == ["hy-rank-0", "hy-rank-2"]
    assert sorted(p["spec"]["nodeName"] for p in rank_pods) == ["a10g-0", "a10g-1"]
    for pod in rank_pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["CEPHALO_PLAN"].endswith("plan.json") and env["CEPHALO_RANKS_PER_POD"] == "2"
    assert sorted(code for _, code in kubelet.exits) == [0, 0], kubelet.exits

    # The ranks trained hybrid: meta.json names the groups; every rank wrote its piece of
    # the optimizer state (4 files, docs/hybrid-sharding.md).
    claim = kubelet.claim_folder(NS, "ckpt-hy")
    [final] = sorted(claim.rglob(f"step-{STEPS:08d}"))
    meta = json.loads((final / "meta.json").read_text())
    assert meta["replica_groups"] == [[0, 1], [2, 3]], meta.get("replica_groups")
    assert sorted(p.name for p in final.glob("rank-*.pt")) == [f"rank-{i:05d}.pt" for i in range(4)]
    progress = status.get("progress") or {}
    assert (progress.get("step"), progress.get("totalSteps")) == (STEPS, STEPS), status
