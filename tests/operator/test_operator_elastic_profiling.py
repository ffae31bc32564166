"""Issue 39 item 1 on the API emulator (the real kopf operator process, cluster_sim playing
kubelet and trainer): an elastic job that planned while another workload held the Tesla-T4s
profiles them once they are free, says so meanwhile, then grows onto them. (The real control
plane runs no GPU pods: the emulator is where a foreign pod can hold GPUs and end.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from pathlib import Path

import pytest
import pytest_asyncio
from elastic_harness import ELASTIC, POOL, Sim, elastic_job, fast_nic, operated, status_of
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node
from kubelet import (
    WAIT_SECONDS,
    apply_job,
    apply_nodes,
    call,
    pods,
    set_pod,
    wait_for,
)
from operator_harness import NS, events

pytestmark = pytest.mark.asyncio
T4 = "Tesla-T4"
FOREIGN = "other-team"


@pytest_asyncio.fixture(name="sim")
async def sim_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Sim]:
    await apply_nodes(emulator, [fast_nic(gpu_node("a10g-0", POOL, 4, 23028)),
                                 fast_nic(gpu_node("t4-0", T4, 4, 15360)),
                                 gpu_node("cpu-0", None, 0)])
    # Another team's pod holds the four T4s (a real scheduler placed it).
    await call(emulator, "POST", f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": FOREIGN, "labels": {"team": "x"}},
        "spec": {"nodeName": "t4-0", "containers": [{
            "name": "main", "image": "other/train",
            "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}}, "application/json")
    await set_pod(emulator, NS, FOREIGN, "Running")
    async with operated(emulator, tmp_path) as sim:
        yield sim


def _decision(api: ApiEmulator) -> dict:
    return (status_of(api, "a").get("elastic") or {}).get("lastDecision") or {}


async def _t4_freed(sim: Sim) -> None:
    """Job a Running on the four A10Gs; then the foreign pod ends. T4 profilers run until
    the test reads their log (or fails them)."""
    await apply_job(sim.api, elastic_job("a", 100_000, elastic=ELASTIC))
    status = await wait_for("a Running on the A10Gs with progress", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Running"
        and (s.get("progress") or {}).get("step") else None), WAIT_SECONDS)
    assert status["plan"]["worldSize"] == 4 and not status.get("elastic")
    assert {p["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
            for p in pods(sim.api, NS, "profiler", "a")} <= {POOL}
    sim.sim.hold_profilers_until_read = True
    await set_pod(sim.api, NS, FOREIGN, "Succeeded")  # the other team's pod ends


async def _t4_profiler(sim: Sim, not_one_of: Collection[str] = ()) -> dict:
    return await wait_for("a profiler pod running on a Tesla-T4", lambda: next(
        (p for p in pods(sim.api, NS, "profiler", "a")
         if p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == T4
         and p["metadata"]["name"] not in not_one_of
         and (p.get("status") or {}).get("phase") == "Running"), None), WAIT_SECONDS)


async def test_a_pool_freed_after_planning_is_profiled_then_grown_onto(sim: Sim) -> None:
    await _t4_freed(sim)
    profiler = await _t4_profiler(sim)
    decision = await wait_for("a says it profiles the T4s", lambda: (
        d if "profiling Tesla-T4 before deciding" in ((d := _decision(sim.api)).get("reason")
                                                       or "") else None), WAIT_SECONDS)
    assert decision["reasonCode"] == "Profiling" and decision["verdict"] == "Skip", decision
    status = status_of(sim.api, "a")
    # Meanwhile the gang trains on as it was: no restart, no rescale.
    assert status["phase"] == "Running" and status["plan"]["worldSize"] == 4
    assert not status.get("restarts") and not status["elastic"].get("rescales")
    # One profiler, for one GPU.
    limits = profiler["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] in (1, "1"), limits
    async with sim.api.request("GET", f"/api/v1/namespaces/{NS}/pods/"
                               f"{profiler['metadata']['name']}/log") as resp:
        assert b"Tesla-T4" in await resp.read()  # read: the sim finishes the profiler now
    status = await wait_for("a Running on 8 GPUs", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Running"
        and s["plan"]["worldSize"] == 8 else None), WAIT_SECONDS)
    decision = status["elastic"]["lastDecision"]
    assert status["elastic"]["rescales"] == 1 and decision["verdict"] == "Rescale", decision
    assert decision["freeGpus"] == {POOL: 4, T4: 4}, decision
    assert not status.get("restarts") and not status.get("preemptions")
    assert status["plan"]["pools"] == {POOL: 4, T4: 4}, status["plan"]
    messages = [m for _, r, m in events(sim.api, "a") if r == "Profiled"]
    assert any(m.startswith(T4) for m in messages), messages


async def test_a_pool_whose_profiler_fails_is_left_out_and_the_job_trains_on(sim: Sim) -> None:
    await _t4_freed(sim)
    failed: set[str] = set()
    for _ in range(3):  # profileRetries 2: three attempts
        name = (await _t4_profiler(sim, failed))["metadata"]["name"]
        await set_pod(sim.api, NS, name, "Failed", exit_code=1, message="CUDA error: no device")
        failed.add(name)
    status = await wait_for("a leaves the T4s out", lambda: (
        s if ((s := status_of(sim.api, "a")).get("elastic") or {}).get("lastDecision", {}).get(
            "reasonCode") == "ProfilingFailed" else None), WAIT_SECONDS)
    failure = status["elastic"]["profileFailures"][T4]
    assert failure["failures"] == 1 and "CUDA error" in failure["reason"], failure
    assert failure["retryTime"] > failure["time"], failure
    # The job trains on, on its four A10Gs: not failed, not restarted, no new profiler.
    assert status["phase"] == "Running" and status["plan"]["worldSize"] == 4
    assert not status.get("restarts") and not status["elastic"].get("rescales")
    assert all(p["metadata"]["name"] in failed or
               p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] != T4
               for p in pods(sim.api, NS, "profiler", "a"))
    warnings = await wait_for("the ElasticProfilingFailed event", lambda: [
        m for t, r, m in events(sim.api, "a") if r == "ElasticProfilingFailed"], WAIT_SECONDS)
    assert len(warnings) == 1 and "left out of elastic growth" in warnings[0], warnings
    # The attempts are not counted against a later re-plan onto the T4s.
    job = next(j for j in sim.api.list_objects("cephalojobs", NS, group="cephalo.dev")
               if j["metadata"]["name"] == "a")
    assert T4 not in (job["metadata"].get("annotations") or {}).get(
        "cephalo.dev/profile-attempts", "{}"), job["metadata"].get("annotations")
