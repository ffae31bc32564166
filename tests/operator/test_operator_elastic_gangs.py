"""Issue 28 under gang schedulers. Kueue (emulated as documented, kueue_emulator.py): an
elastic job's grown gang goes through admission like any other gang, as a new pod group; a
grown gang that Kueue does not admit (the ClusterQueue's quota is smaller than what the
nodes offer) goes back to the GPUs the job had after `spec.elastic.rescaleTimeoutSeconds`,
instead of leaving the job waiting with no GPUs (it had drained its ranks to grow).
Volcano: the grown gang has a PodGroup of its own (minMember 8), created before its pods;
the old one is deleted."""

from __future__ import annotations

import pytest
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
    running_on,
    running_with_progress,
    sim_fixture,
    status_of,
    succeeded,
    world_sizes,
)
from kubelet import JOBS, WAIT_SECONDS, apply_job, call, pods, wait_for
from kueue_emulator import GROUP_LABEL, QUEUE_LABEL, KueueEmulation, gated
from operator_harness import NS, events

from cephalo.operator.gang import POD_GROUP_APIS

pytestmark = pytest.mark.asyncio
QUEUE = {QUEUE_LABEL: "team-a"}


def _queued(body: dict) -> dict:
    body["metadata"]["labels"] = dict(QUEUE)
    return body


def _groups(sim: Sim, name: str) -> set[str]:
    return {p["metadata"]["labels"][GROUP_LABEL] for p in pods(sim.api, NS, "trainer", name)}


async def _both_nodes_ready(sim: Sim) -> None:
    await call(sim.api, "PATCH", "/api/v1/nodes/a10g-1/status", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})


async def test_under_kueue_the_grown_gang_is_admitted_as_a_new_group(sim: Sim) -> None:
    kueue = KueueEmulation(sim.api, quota={POOL: 8}).install()
    await _both_nodes_ready(sim)
    sim.sim.idle_jobs.add("b")
    await apply_job(sim.api, _queued(elastic_job("b", 10_000, maxGpus=4)))
    await running_on(sim.api, "b", 4)
    hold(sim, "a", HELD_AT)
    await apply_job(sim.api, _queued(elastic_job("a", STEPS, elastic=SHORT_ELASTIC)))
    await running_with_progress(sim.api, "a")
    (first,) = _groups(sim, "a")
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")  # b ends: its quota is free
    status = await running_on(sim.api, "a", 8)
    (grown,) = _groups(sim, "a")
    assert grown != first  # a new gang: a new Workload, admitted as one unit
    assert (NS, grown) in kueue.admissions and (NS, first) in kueue.finished
    assert kueue.usage() == {POOL: 8}
    assert status["elastic"]["rescales"] == 1 and not status["elastic"].get("rollbacks")
    release(sim, "a")
    status = await succeeded(sim.api, "a")
    assert world_sizes(sim.api, "a") == [4, 8]
    assert not status.get("restarts") and not status.get("preemptions")


async def test_a_grown_gang_kueue_does_not_admit_goes_back_to_the_gpus_it_had(
        sim: Sim) -> None:
    # team-a's ClusterQueue has 4 A10Gs; b, outside Kueue, holds the other 4 of the nodes.
    kueue = KueueEmulation(sim.api, quota={POOL: 4}).install()
    await _both_nodes_ready(sim)
    await hold_four_gpus(sim)
    timeout = 2
    hold(sim, "a", HELD_AT)
    # 300 steps: once released, it runs for seconds in which a retried offer would show.
    await apply_job(sim.api, _queued(elastic_job("a", 300, elastic={
        **ELASTIC, "rescaleTimeoutSeconds": timeout})))
    await running_with_progress(sim.api, "a")
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")  # 8 GPUs free on the nodes
    # a grows (the nodes offer 8), but Kueue holds the 8-rank group at its gate: quota 4.
    await wait_for("a's 8 ranks gated", lambda: len(
        ps := [p for p in pods(sim.api, NS, "trainer", "a")
               if not p["metadata"].get("deletionTimestamp")]) == 8 and all(
        gated(p) for p in ps), WAIT_SECONDS)
    status = await running_on(sim.api, "a", 4)  # back on the GPUs it had, admitted again
    elastic = status["elastic"]
    decision = elastic["lastDecision"]
    assert elastic["rescales"] == 1 and elastic["rollbacks"] == 1, elastic
    assert decision["verdict"] == "Skip" and decision["reasonCode"] == "NotAdmitted"
    assert f"rescaleTimeoutSeconds {timeout}" in decision["reason"], decision
    assert decision["retryTime"] > decision["time"]  # not tried again at once
    assert "rescaleStartedTime" not in elastic
    reasons = [r for _, r, _ in events(sim.api, "a")]
    assert reasons.count("Rescaled") == 1 and reasons.count("RescaleRolledBack") == 1, reasons
    # Rank groups admitted: the first 4, then the 4 it went back to (never the 8).
    assert len([w for w in kueue.admissions if "-profile-" not in w[1]]) == 2, kueue.admissions
    release(sim, "a")
    status = await succeeded(sim.api, "a")
    assert world_sizes(sim.api, "a") == [4, 8, 4]
    assert status["elastic"]["rescales"] == 1  # the offer is not retried within the cooldown
    assert not status.get("restarts") and not status.get("preemptions")


async def test_under_volcano_the_grown_gang_has_a_pod_group_of_its_own(sim: Sim) -> None:
    volcano = POD_GROUP_APIS["volcano"]
    sim.api.add_resource(volcano.group, volcano.version, volcano.plural, volcano.kind)
    await _both_nodes_ready(sim)
    await hold_four_gpus(sim)
    policy = {"schedulerName": "volcano", "queue": "research"}
    hold(sim, "a", HELD_AT)
    await apply_job(sim.api, elastic_job("a", STEPS, elastic=SHORT_ELASTIC,
                                         schedulingPolicy=policy))
    await running_with_progress(sim.api, "a")

    def groups() -> list[dict]:
        return [g for g in sim.api.list_objects(volcano.plural, NS, group=volcano.group)
                if g["metadata"]["labels"].get("cephalo.dev/job") == "a"
                and not g["metadata"].get("deletionTimestamp")]

    (first,) = groups()
    assert first["spec"]["minMember"] == 4
    await call(sim.api, "DELETE", JOBS.format(ns=NS) + "/b")
    await running_on(sim.api, "a", 8)
    (grown,) = groups()  # the old PodGroup deleted (its queue reservation let go)
    assert grown["metadata"]["name"] != first["metadata"]["name"]
    assert grown["spec"]["minMember"] == 8 and grown["spec"]["queue"] == "research"
    ranks = [p for p in pods(sim.api, NS, "trainer", "a")
             if not p["metadata"].get("deletionTimestamp")]
    assert len(ranks) == 8 and {p["metadata"]["annotations"]["scheduling.k8s.io/group-name"]
                                for p in ranks} == {grown["metadata"]["name"]}
    created = [c for c in sim.api.calls if c.verb == "create" and c.committed and (
        c.resource == volcano.plural or (c.resource == "pods" and "-rank-" in (c.name or "")))
        and (c.name or "").startswith("a-")]
    grown_at = next(i for i, c in enumerate(created) if c.name == grown["metadata"]["name"])
    # The PodGroup before its pods: all 8 of the grown gang are created after it.
    assert [c.resource for c in created[grown_at + 1:]] == ["pods"] * 8, created
    release(sim, "a")
    status = await succeeded(sim.api, "a")
    assert status["elastic"]["rescales"] == 1 and world_sizes(sim.api, "a") == [4, 8]
