"""Issue 28 end to end, the operator's side: the real kopf operator process against the API
emulator, with cluster_sim.TrainingSim playing kubelet and trainer (fast: no torch). An
elastic job grows onto the GPUs another job lets go, counted as a rescale and explained in
status; a node that flaps five times causes at most one rescale; a job without
spec.elastic never rescales. (test_operator_elastic_e2e.py runs real trainer processes.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from aiohttp import ClientSession
from cli_in_process import cephalo_in_process
from elastic_harness import (  # noqa: F401 (the sim fixture)
    ELASTIC,
    HELD_AT,
    POOL,
    SHORT_ELASTIC,
    STEPS,
    Sim,
    elastic_job,
    hold,
    hold_four_gpus,
    release,
    running_with_progress,
    sim_fixture,
    status_of,
    world_sizes,
)
from kubelet import JOBS, WAIT_SECONDS, apply_job, call, wait_for
from operator_harness import NS, events, plan_of

pytestmark = pytest.mark.asyncio


async def _metrics(port: int) -> str:
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return await resp.text()


async def test_an_elastic_job_grows_when_another_job_lets_its_gpus_go(sim: Sim,
                                                                      tmp_path: Path) -> None:
    await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})
    await hold_four_gpus(sim)
    hold(sim, "a", HELD_AT)  # still Running when it has grown, however long that takes
    await apply_job(sim.api, elastic_job("a", STEPS, elastic=SHORT_ELASTIC))
    status = await running_with_progress(sim.api, "a")
    assert status["plan"]["worldSize"] == 4 and not status.get("elastic")
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")  # b ends: its GPUs are free
    status = await wait_for("a rescaled to 8 GPUs and Running", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Running"
        and s["plan"]["worldSize"] == 8 else None), WAIT_SECONDS)
    # The grown gang's first steps end the rescale; held again while the client explains it.
    hold(sim, "a", 2 * HELD_AT)
    elastic = status["elastic"]
    decision = elastic["lastDecision"]
    assert elastic["rescales"] == 1 and decision["verdict"] == "Rescale"
    assert decision["freeGpus"] == {POOL: 8}
    assert (decision["currentGpus"], decision["candidateGpus"]) == (4, 8)
    assert decision["candidateSamplesPerSecond"] > 1.1 * decision["currentSamplesPerSecond"]
    assert decision["savedSeconds"] > decision["restartCostSeconds"] == 0.05
    assert decision["restartCostSource"] == "default"
    # Not a failure, not a preemption; the old ranks drained through the stale-pod path.
    assert not status.get("restarts") and not status.get("preemptions")
    assert plan_of(sim.api, "a").world_size == 8
    status = await wait_for("a's restart measured", lambda: (
        s if (s := status_of(sim.api, "a")).get("elastic", {}).get("restartSeconds") else None),
        WAIT_SECONDS)
    assert "rescaleStartedTime" not in status["elastic"]
    reasons = [r for _, r, _ in events(sim.api, "a")]
    assert reasons.count("Rescaled") == 1 and "RescaleSkipped" not in reasons
    text = await _metrics(sim.operator.metrics_port)
    assert 'cephalo_operator_rescales_total{cephalo_job="a",cephalo_namespace="default"} 1.0' \
        in text
    # The client explains it: `cephalo status a` and `cephalo plan --cluster --job`.
    # (in process: test_client_cli runs the console script itself)
    job_file = tmp_path / "a.yaml"
    job_file.write_text(yaml.safe_dump(elastic_job("a", STEPS, elastic=SHORT_ELASTIC)))
    for args in (["status", "a"], ["plan", "--cluster", "--job", str(job_file)]):
        _, out, err = await cephalo_in_process(sim.api.kubeconfig, *args)
        text = out + err
        print(text)  # the README's example
        assert "Elastic:" in text and "1 rescale(s)" in text, text
        assert "rescaled; could use NVIDIA-A10G x8: 4 -> 8 GPUs: predicted" in text, text
    release(sim, "a")
    status = await wait_for("a Succeeded", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Succeeded" else None), WAIT_SECONDS)
    assert world_sizes(sim.api, "a") == [4, 8]


def _lists_configmaps_in_the_jobs_namespace(req: Any) -> bool:
    """The operator's LIST of ConfigMaps in the job's namespace: what the chart's RBAC
    refuses (its ClusterRole gets ConfigMaps by name; LIST only in the operator's own
    namespace, by a Role)."""
    res = req.resource
    return not req.headers.get("User-Agent", "").startswith("kmock/") and res is not None \
        and res.plural == "configmaps" and str(req.method.value) == "GET" \
        and req.name is None and req.namespace == NS


async def test_a_network_cache_the_operator_may_not_list_is_no_cached_network(
        sim: Sim) -> None:
    """An operator started without CEPHALO_OPERATOR_NAMESPACE under the chart's RBAC: the
    network cache is looked for in the job's namespace, where LIST is refused (403). The
    rescale plans with no cached network and says so once in the log; the reconcile never
    fails on it (it did: the job stayed on 4 GPUs, each pass raising the 403)."""
    sim.api[_lists_configmaps_in_the_jobs_namespace] << kmock.KubernetesError(
        status=403, reason="Forbidden", message="forbidden by the chart's RBAC", details={})
    await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})
    await hold_four_gpus(sim)
    await apply_job(sim.api, elastic_job("a", 400, elastic=ELASTIC))
    status = await running_with_progress(sim.api, "a")
    assert status["plan"]["worldSize"] == 4
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")  # b ends: its GPUs are free
    status = await wait_for("a rescaled to 8 GPUs and Running", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Running"
        and s["plan"]["worldSize"] == 8 else None), WAIT_SECONDS)
    assert status["elastic"]["rescales"] == 1
    refused = [c for c in sim.api.calls if c.resource == "configmaps" and c.verb == "list"
               and c.namespace == NS]
    assert refused, "the operator never looked for the network cache"
    log = sim.operator.log()
    assert log.count("network cache") == 1, log[-4000:]
    assert "CEPHALO_OPERATOR_NAMESPACE" in log


async def test_a_node_that_flaps_five_times_causes_at_most_one_rescale(sim: Sim) -> None:
    await apply_job(sim.api, elastic_job("a", 400, elastic=ELASTIC))
    status = await running_with_progress(sim.api, "a")
    assert status["plan"]["worldSize"] == 4  # a10g-1 is NotReady

    async def ready(value: bool) -> None:
        await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {
            "conditions": [{"type": "Ready", "status": "True" if value else "False"}]}})

    # The first flap: the job grows onto the node, then loses it again (a re-plan down,
    # GPUs lost, which is no rescale), each awaited as the operator's own result.
    await ready(True)
    await wait_for("a Running on 8 GPUs", lambda: (s := status_of(sim.api, "a")).get(
        "plan", {}).get("worldSize") == 8 and s.get("phase") == "Running", WAIT_SECONDS)
    await ready(False)
    await wait_for("a back on 4 GPUs and Running", lambda: (
        s := status_of(sim.api, "a")).get("plan", {}).get("worldSize") == 4
        and s.get("phase") == "Running", WAIT_SECONDS)
    await ready(True)  # the second flap: within the cooldown, so it only says why not
    await wait_for("a skipping for the cooldown", lambda: status_of(sim.api, "a").get(
        "elastic", {}).get("lastDecision", {}).get("reasonCode") == "Cooldown", WAIT_SECONDS)
    await ready(False)
    for _ in range(3):  # three more flaps, faster than anything settles: nothing to wait on
        await asyncio.sleep(0.3)
        await ready(True)
        await asyncio.sleep(0.3)
        await ready(False)
    status = await wait_for("a Succeeded", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Succeeded" else None), WAIT_SECONDS)
    assert status["elastic"]["rescales"] == 1
    reasons = [r for _, r, _ in events(sim.api, "a")]
    assert reasons.count("Rescaled") == 1 and reasons.count("RescaleSkipped") == 1, reasons
    assert not status.get("restarts") and not status.get("preemptions")


async def test_a_job_without_elastic_never_rescales(sim: Sim) -> None:
    await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})
    await hold_four_gpus(sim)
    await apply_job(sim.api, elastic_job("a", 200, elastic={"enabled": False}))
    await running_with_progress(sim.api, "a")
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")
    status = await wait_for("a Succeeded", lambda: (
        s if (s := status_of(sim.api, "a")).get("phase") == "Succeeded" else None), WAIT_SECONDS)
    assert world_sizes(sim.api, "a") == [4] and not status.get("elastic")
    assert not {"Rescaled", "RescaleSkipped"} & {r for _, r, _ in events(sim.api, "a")}
