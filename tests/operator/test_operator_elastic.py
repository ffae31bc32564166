"""Issue 28 end to end, the operator's side: the real kopf operator process against the API
emulator, with cluster_sim.TrainingSim playing kubelet and trainer (fast: no torch). An
elastic job grows onto the GPUs another job lets go, counted as a rescale and explained in
status; a node that flaps five times causes at most one rescale; a job without
spec.elastic never rescales. (test_operator_elastic_e2e.py runs real trainer processes.)"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from aiohttp import ClientSession
from cluster_sim import TrainingSim, operator_env
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    JOBS,
    WAIT_SECONDS,
    OperatorProcess,
    apply_job,
    apply_nodes,
    call,
    job_status,
    wait_for,
)
from operator_harness import NS, events, plan_of

from cephalo.operator.rbac import allowed

pytestmark = pytest.mark.asyncio
POOL = "NVIDIA-A10G"
# Big enough that 8 A10Gs are predicted much faster than 4 (a small model is not).
MODEL = {"preset": "gpt-1.3b"}
BATCH = 256


class Sim:
    def __init__(self, api: ApiEmulator, sim: TrainingSim, operator: OperatorProcess) -> None:
        self.api, self.sim, self.operator = api, sim, operator


@pytest_asyncio.fixture(name="sim")
async def sim_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Sim]:
    """Two nodes of 4 A10Gs (the second NotReady until a test says otherwise), the operator,
    the sim: 40 steps a second, whatever the plan."""
    await apply_nodes(emulator, [gpu_node("a10g-0", POOL, 4, 23028),
                                 gpu_node("a10g-1", POOL, 4, 23028, ready=False),
                                 gpu_node("cpu-0", None, 0)])
    sim = await TrainingSim(emulator, steps_per_tick=2, tick_seconds=0.05).start()
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_NODE_DEBOUNCE_SECONDS="0.2", **operator_env(sim)).start()
    try:
        yield Sim(emulator, sim, proc)
    finally:
        await proc.stop()
        await sim.stop()
        print(proc.log()[-8000:])  # shown only when the test failed
    used = emulator.rbac_rules(include_tests=False)
    missing = sorted(r for r in used if not allowed(r[0], r[1], r[2]))
    assert not missing, f"operator used permissions missing from cephalo.operator.rbac: {missing}"


def _job(name: str, steps: int, **spec: Any) -> dict[str, Any]:
    return job_body(name, model=MODEL, globalBatchSize=BATCH, training={"steps": steps},
                    **spec)


ELASTIC = {"enabled": True, "restartCostSeconds": 0.5, "cooldownSeconds": 300}


def _status(api: ApiEmulator, name: str) -> dict[str, Any]:
    return job_status(api, NS, name)


def _world_sizes(api: ApiEmulator, name: str) -> list[int]:
    """Every world size the job's status ever reported (its plan summary's history)."""
    sizes: list[int] = []
    for version in api.history("cephalojobs", NS, name, group="cephalo.dev"):
        size = ((version.get("status") or {}).get("plan") or {}).get("worldSize")
        if size and (not sizes or sizes[-1] != size):
            sizes.append(size)
    return sizes


async def _running_with_progress(api: ApiEmulator, name: str) -> dict[str, Any]:
    return await wait_for(f"{name} Running with progress", lambda: (
        s if (s := _status(api, name)).get("phase") == "Running"
        and (s.get("progress") or {}).get("step") else None), WAIT_SECONDS)


async def _metrics(port: int) -> str:
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return await resp.text()


async def _hold_four_gpus(s: Sim) -> None:
    """Job b: 4 of the 8 GPUs, ranks that run but never step (the test ends b)."""
    s.sim.idle_jobs.add("b")
    await apply_job(s.api, _job("b", 10_000, maxGpus=4))
    await wait_for("b Running on 4 GPUs", lambda: _status(s.api, "b").get("phase") == "Running"
                   and _status(s.api, "b")["plan"]["worldSize"] == 4, WAIT_SECONDS)


async def test_an_elastic_job_grows_when_another_job_lets_its_gpus_go(sim: Sim,
                                                                      tmp_path: Path) -> None:
    await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})
    await _hold_four_gpus(sim)
    await apply_job(sim.api, _job("a", 400, elastic=ELASTIC))
    status = await _running_with_progress(sim.api, "a")
    assert status["plan"]["worldSize"] == 4 and not status.get("elastic")
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")  # b ends: its GPUs are free
    status = await wait_for("a rescaled to 8 GPUs and Running", lambda: (
        s if (s := _status(sim.api, "a")).get("phase") == "Running"
        and s["plan"]["worldSize"] == 8 else None), WAIT_SECONDS)
    elastic = status["elastic"]
    decision = elastic["lastDecision"]
    assert elastic["rescales"] == 1 and decision["verdict"] == "Rescale"
    assert decision["freeGpus"] == {POOL: 8}
    assert (decision["currentGpus"], decision["candidateGpus"]) == (4, 8)
    assert decision["candidateSamplesPerSecond"] > 1.1 * decision["currentSamplesPerSecond"]
    assert decision["savedSeconds"] > decision["restartCostSeconds"] == 0.5
    assert decision["restartCostSource"] == "default"
    # Not a failure, not a preemption; the old ranks drained through the stale-pod path.
    assert not status.get("restarts") and not status.get("preemptions")
    assert plan_of(sim.api, "a").world_size == 8
    status = await wait_for("a's restart measured", lambda: (
        s if (s := _status(sim.api, "a")).get("elastic", {}).get("restartSeconds") else None),
        WAIT_SECONDS)
    assert "rescaleStartedTime" not in status["elastic"]
    reasons = [r for _, r, _ in events(sim.api, "a")]
    assert reasons.count("Rescaled") == 1 and "RescaleSkipped" not in reasons
    text = await _metrics(sim.operator.metrics_port)
    assert 'cephalo_operator_rescales_total{cephalo_job="a",cephalo_namespace="default"} 1.0' \
        in text
    # The client explains it: `cephalo status a` and `cephalo plan --cluster --job`.
    env = {**os.environ, "KUBECONFIG": str(sim.api.kubeconfig)}
    job_file = tmp_path / "a.yaml"
    job_file.write_text(yaml.safe_dump(_job("a", 400, elastic=ELASTIC)))
    for args in (["status", "a"], ["plan", "--cluster", "--job", str(job_file)]):
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "cephalo"), *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), WAIT_SECONDS)
        text = out.decode() + err.decode()
        print(text)  # the README's example
        assert "Elastic:" in text and "1 rescale(s)" in text, text
        assert "rescaled; could use NVIDIA-A10G x8: 4 -> 8 GPUs: predicted" in text, text
    status = await wait_for("a Succeeded", lambda: (
        s if (s := _status(sim.api, "a")).get("phase") == "Succeeded" else None), WAIT_SECONDS)
    assert _world_sizes(sim.api, "a") == [4, 8]


async def test_a_node_that_flaps_five_times_causes_at_most_one_rescale(sim: Sim) -> None:
    await apply_job(sim.api, _job("a", 400, elastic=ELASTIC))
    status = await _running_with_progress(sim.api, "a")
    assert status["plan"]["worldSize"] == 4  # a10g-1 is NotReady

    async def ready(value: bool) -> None:
        await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {
            "conditions": [{"type": "Ready", "status": "True" if value else "False"}]}})

    # The first flap: the job grows onto the node, then loses it again (a re-plan down,
    # GPUs lost, which is no rescale), each awaited as the operator's own result.
    await ready(True)
    await wait_for("a Running on 8 GPUs", lambda: (s := _status(sim.api, "a")).get(
        "plan", {}).get("worldSize") == 8 and s.get("phase") == "Running", WAIT_SECONDS)
    await ready(False)
    await wait_for("a back on 4 GPUs and Running", lambda: (
        s := _status(sim.api, "a")).get("plan", {}).get("worldSize") == 4
        and s.get("phase") == "Running", WAIT_SECONDS)
    await ready(True)  # the second flap: within the cooldown, so it only says why not
    await wait_for("a skipping for the cooldown", lambda: _status(sim.api, "a").get(
        "elastic", {}).get("lastDecision", {}).get("reasonCode") == "Cooldown", WAIT_SECONDS)
    await ready(False)
    for _ in range(3):  # three more flaps, faster than anything settles: nothing to wait on
        await asyncio.sleep(0.3)
        await ready(True)
        await asyncio.sleep(0.3)
        await ready(False)
    status = await wait_for("a Succeeded", lambda: (
        s if (s := _status(sim.api, "a")).get("phase") == "Succeeded" else None), WAIT_SECONDS)
    assert status["elastic"]["rescales"] == 1
    reasons = [r for _, r, _ in events(sim.api, "a")]
    assert reasons.count("Rescaled") == 1 and reasons.count("RescaleSkipped") == 1, reasons
    assert not status.get("restarts") and not status.get("preemptions")


async def test_a_job_without_elastic_never_rescales(sim: Sim) -> None:
    await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})
    await _hold_four_gpus(sim)
    await apply_job(sim.api, _job("a", 200, elastic={"enabled": False}))
    await _running_with_progress(sim.api, "a")
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")
    status = await wait_for("a Succeeded", lambda: (
        s if (s := _status(sim.api, "a")).get("phase") == "Succeeded" else None), WAIT_SECONDS)
    assert _world_sizes(sim.api, "a") == [4] and not status.get("elastic")
    assert not {"Rescaled", "RescaleSkipped"} & {r for _, r, _ in events(sim.api, "a")}
