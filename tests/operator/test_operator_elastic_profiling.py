"""Issue 39 item 1 on the API emulator (the real kopf operator process, cluster_sim playing
kubelet and trainer): an elastic job that planned while another workload held the Tesla-T4s
profiles them once they are free, says so meanwhile, then grows onto them. (The real control
plane runs no GPU pods: the emulator is where a foreign pod can hold GPUs and end.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cluster_sim import TrainingSim, operator_env
from elastic_harness import ELASTIC, POOL, Sim, elastic_job, fast_nic, status_of
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node
from kubelet import (
    WAIT_SECONDS,
    OperatorProcess,
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
    sim = await TrainingSim(emulator, steps_per_tick=2, tick_seconds=0.05).start()
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_NODE_DEBOUNCE_SECONDS="0.2", **operator_env(sim)).start()
    try:
        yield Sim(emulator, sim, proc)
    finally:
        await proc.stop()
        await sim.stop()
        print(proc.log()[-8000:])  # shown only when the test failed


def _decision(api: ApiEmulator) -> dict:
    return (status_of(api, "a").get("elastic") or {}).get("lastDecision") or {}


async def test_a_pool_freed_after_planning_is_profiled_then_grown_onto(sim: Sim) -> None:
    await apply_job(sim.api, elastic_job("a", 100_000, elastic=ELASTIC))
    status = await wait_for("a Running on the A10Gs with progress", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Running"
        and (s.get("progress") or {}).get("step") else None), WAIT_SECONDS)
    assert status["plan"]["worldSize"] == 4 and not status.get("elastic")
    assert {p["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
            for p in pods(sim.api, NS, "profiler", "a")} <= {POOL}
    # The T4 profiler runs until the test has seen what the job says meanwhile.
    sim.sim.hold_profilers_until_read = True
    await set_pod(sim.api, NS, FOREIGN, "Succeeded")  # the other team's pod ends
    profiler = await wait_for("a profiler pod on a Tesla-T4", lambda: next(
        (p for p in pods(sim.api, NS, "profiler", "a")
         if p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == T4), None), WAIT_SECONDS)
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
