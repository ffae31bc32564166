"""Issue 46 items 5 and 8 end to end: the network probe's cache is the cluster's, and a job
that loses GPUs is re-planned at once on the links already measured.

The kopf operator process runs against the API emulator with its network probe on; cluster_sim's
TrainingSim plays kubelet and trainer, finishing a probe's pods at once with a 10 Gbit/s fit.
In the recovery test a scheduler binds pods to nodes with room for their GPUs and the sim runs
only bound pods, so a probe competes for GPUs with the job's own ranks, as on a cluster.

* Item 5: a job in namespace team-a measures the links of two pools; a job in namespace
  team-b on the same nodes plans with those measurements: no probe pod at all. The cache
  lives in the operator's namespace (none in the jobs'), and no job name is in it.
* Item 8: a job Running on two A10G nodes (4 GPUs each) and a T4 node loses the T4 node. The
  A10G pool's NIC was measured in its A10G <-> T4 probe, so the re-plan on the A10G nodes
  alone creates no probe pod (an A10G <-> A10G probe would need GPUs the job's ranks hold)
  and its 8 new ranks run. The seconds from NotReady to every new rank running are printed
  (a figure for the record, never a verdict: it depends on the machine).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from cluster_sim import TrainingSim, operator_env
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    WAIT_SECONDS,
    OperatorProcess,
    Scheduler,
    apply_job,
    apply_nodes,
    call,
    job_status,
    pods,
    wait_for,
)

from cephalo.api.network_profile import MEASURED_SOURCE, NETWORK_PROFILE_KEY, NetworkProfile
from cephalo.operator.rbac import allowed

pytestmark = pytest.mark.asyncio
OPERATOR_NS = "cephalo-system"  # where the chart installs the operator (its downward API)
PROBE_LABEL = "cephalo.dev/netprobe"


class Cluster:
    def __init__(self, api: ApiEmulator, sim: TrainingSim, operator: OperatorProcess) -> None:
        self.api, self.sim, self.operator = api, sim, operator
        self.probe_pods: list[tuple[float, str]] = []  # (monotonic time, ns/name) created
        # What happened, in the order the API server saw it (no clock): ("probe", name) when
        # a probe pod is created, ("running", uid) when a rank pod first runs.
        self.order: list[tuple[str, str]] = []
        api.on_change.append(self._changed)

    def _changed(self, key: tuple[Any, ...], kind: str, obj: dict[str, Any]) -> None:
        labels = obj.get("metadata", {}).get("labels") or {}
        if key[:2] != ("", "pods"):
            return
        if kind == "ADDED" and PROBE_LABEL in labels:
            self.probe_pods.append((time.monotonic(), f"{key[2]}/{key[3]}"))
            self.order.append(("probe", key[3]))
        running = ("running", str(obj["metadata"].get("uid")))
        if labels.get("cephalo.dev/role") == "trainer" and running not in self.order and \
                (obj.get("status") or {}).get("phase") == "Running":
            self.order.append(running)


async def _operated(api: ApiEmulator, tmp_path: Path, nodes: list[dict[str, Any]],
                    scheduled: bool) -> AsyncIterator[Cluster]:
    await apply_nodes(api, [*nodes, gpu_node("cpu-0", None, 0)])
    if scheduled:
        Scheduler(api, run=False)  # binds; the sim runs what is bound
    sim = await TrainingSim(api, steps_per_tick=2, tick_seconds=0.05, netprobe_gbps=10.0,
                            scheduled_only=scheduled).start()
    proc = OperatorProcess(api.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_NETWORK_PROBE="true", CEPHALO_NODE_DEBOUNCE_SECONDS="0.2",
                           CEPHALO_OPERATOR_NAMESPACE=OPERATOR_NS, **operator_env(sim)).start()
    try:
        yield Cluster(api, sim, proc)
    finally:
        await proc.stop()
        await sim.stop()
        print(proc.log()[-8000:])  # shown only when the test failed
    used = api.rbac_rules(include_tests=False)
    missing = sorted(r for r in used if not allowed(r[0], r[1], r[2]))
    assert not missing, f"operator used permissions missing from cephalo.operator.rbac: {missing}"


@pytest_asyncio.fixture(name="two_pools")
async def two_pools_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Cluster]:
    async for cluster in _operated(emulator, tmp_path, [
            gpu_node("l4-0", "NVIDIA-L4", 2, 23034), gpu_node("a10g-0", "NVIDIA-A10G", 1, 23028)],
            scheduled=False):
        yield cluster


@pytest_asyncio.fixture(name="lossy")
async def lossy_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Cluster]:
    async for cluster in _operated(emulator, tmp_path, [
            gpu_node("a10g-0", "NVIDIA-A10G", 4, 23028),
            gpu_node("a10g-1", "NVIDIA-A10G", 4, 23028),
            gpu_node("t4-0", "Tesla-T4", 1, 15360)], scheduled=True):
        yield cluster


@pytest_asyncio.fixture(name="replaced")
async def replaced_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Cluster]:
    async for cluster in _operated(emulator, tmp_path, [
            gpu_node("a10g-0", "NVIDIA-A10G", 4, 23028),
            gpu_node("a10g-1", "NVIDIA-A10G", 4, 23028),
            gpu_node("l4-0", "NVIDIA-L4", 2, 23034, ready=False),  # Ready when t4-0 goes
            gpu_node("t4-0", "Tesla-T4", 1, 15360)], scheduled=True):
        yield cluster


def _status(api: ApiEmulator, ns: str, name: str) -> dict[str, Any]:
    return job_status(api, ns, name)


async def _succeeded(api: ApiEmulator, ns: str, name: str) -> dict[str, Any]:
    status = await wait_for(f"{ns}/{name} finished", lambda: (
        s if (s := _status(api, ns, name)).get("phase") in ("Succeeded", "Failed") else None))
    assert status["phase"] == "Succeeded", status.get("message")
    return status


def _network_config_maps(api: ApiEmulator) -> dict[tuple[str, str], dict[str, Any]]:
    return {(key[2], key[3]): cm for key, cm in list(api._store.items())
            if key[:2] == ("", "configmaps")
            and (cm["metadata"].get("labels") or {}).get("cephalo.dev/network-profile")}


async def test_a_job_in_another_namespace_reuses_the_measured_network(
        two_pools: Cluster) -> None:
    api = two_pools.api
    pools = [{"product": "L4"}, {"product": "A10G"}]
    await apply_job(api, job_body("first", "team-a", gpuPools=pools, training={"steps": 20}))
    first = await _succeeded(api, "team-a", "first")
    assert first["plan"]["networkSource"] == MEASURED_SOURCE, first["plan"]
    probed = [name for _, name in two_pools.probe_pods]
    assert probed and all(name.startswith("team-a/first-netprobe-") for name in probed), probed

    await apply_job(api, job_body("second", "team-b", gpuPools=pools, training={"steps": 20}))
    second = await _succeeded(api, "team-b", "second")
    assert [name for _, name in two_pools.probe_pods] == probed  # no probe for team-b
    assert second["plan"]["networkSource"] == MEASURED_SOURCE, second["plan"]
    measured = {c["type"]: c for c in second["conditions"]}["NetworkMeasured"]
    assert measured["status"] == "True", measured
    assert "team-a" not in measured["message"] and "first" not in measured["message"]

    cached = _network_config_maps(api)
    assert {ns for ns, _ in cached} == {OPERATOR_NS}, sorted(cached)  # none in a job's
    assert len(cached) == 2, sorted(cached)  # L4 <-> A10G across nodes, L4 x2 on l4-0
    for cm in cached.values():  # no namespace or job name in what is cached
        text = str(cm["data"])
        assert "team-a" not in text and "first" not in text, cm["data"]
        profile = NetworkProfile.model_validate_json(cm["data"][NETWORK_PROFILE_KEY])
        assert profile.measured_for == _uid(api, "team-a", "first")


def _uid(api: ApiEmulator, ns: str, name: str) -> str:
    return str(api._store[("cephalo.dev", "cephalojobs", ns, name)]["metadata"]["uid"])


def _ranks_running(api: ApiEmulator, name: str, world_size: int) -> list[dict[str, Any]] | None:
    """The job's rank pods when they are `world_size`, of one attempt, all Running."""
    ranks = [p for p in pods(api, "default", "trainer", name)
             if not p["metadata"].get("deletionTimestamp")]
    attempts = {p["metadata"]["labels"].get("cephalo.dev/attempt") for p in ranks}
    hashes = {p["metadata"].get("annotations", {}).get("cephalo.dev/config-hash") for p in ranks}
    running = all((p.get("status") or {}).get("phase") == "Running" for p in ranks)
    return ranks if len(ranks) == world_size and len(attempts) == len(hashes) == 1 \
        and running else None


async def test_a_job_that_loses_a_node_restarts_without_waiting_on_a_probe(
        lossy: Cluster) -> None:
    api = lossy.api
    lossy.sim.idle_jobs.add("r")  # ranks that hold their GPUs and never finish
    await apply_job(api, job_body("r", training={"steps": 100_000},
                                  gpuPools=[{"product": "A10G"}, {"product": "T4"}]))
    await wait_for("r Running on 9 GPUs", lambda: (
        s := _status(api, "default", "r")).get("phase") == "Running"
        and (s.get("plan") or {}).get("worldSize") == 9 and _ranks_running(api, "r", 9))
    assert _status(api, "default", "r")["plan"]["networkSource"] == MEASURED_SOURCE
    before = [name for _, name in lossy.probe_pods]
    assert before, "the first plan measured nothing"
    old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(api, "default", "trainer")}

    lost = time.monotonic()
    await call(api, "PATCH", "/api/v1/nodes/t4-0/status", {"status": {
        "conditions": [{"type": "Ready", "status": "False"}]}})

    def restarted() -> list[dict[str, Any]] | None:
        ranks = _ranks_running(api, "r", 8)
        return ranks if ranks and not {p["metadata"]["uid"] for p in ranks} & set(
            old.values()) else None

    ranks = await wait_for("r's 8 new ranks Running", restarted, WAIT_SECONDS)
    seconds = time.monotonic() - lost
    print(f"NotReady -> every new rank Running: {seconds:.1f} s")
    assert {p["spec"]["nodeName"] for p in ranks} == {"a10g-0", "a10g-1"}
    # The re-plan measured nothing: the A10G pool's NIC came from its A10G <-> T4 probe.
    assert [name for _, name in lossy.probe_pods] == before, lossy.probe_pods
    status = _status(api, "default", "r")
    assert status["plan"]["networkSource"] == MEASURED_SOURCE, status["plan"]
    measured = {c["type"]: c for c in status["conditions"]}["NetworkMeasured"]
    assert measured["status"] == "True", measured


def _condition(api: ApiEmulator, name: str, type_: str) -> dict[str, Any]:
    return {c["type"]: c for c in _status(api, "default", name).get("conditions") or []}.get(
        type_) or {}


async def test_a_pool_never_measured_is_probed_beside_the_recovered_gang(
        replaced: Cluster) -> None:
    """The T4 node goes and an L4 node takes its place: the re-plan runs on 6 A10G + 1 L4 at
    once (the L4 pool's NIC never measured, so assumed), then the A10G <-> L4 probe runs on
    the GPUs neither the job nor anyone else holds (2 A10G, 1 L4), its measurement is cached
    and the job's NetworkMeasured turns True, with the gang never restarted for it."""
    api = replaced.api
    replaced.sim.idle_jobs.add("r")  # ranks that hold their GPUs and never finish
    await apply_job(api, job_body("r", training={"steps": 100_000}, globalBatchSize=14, gpuPools=[
        {"product": "A10G", "maxGpus": 6}, {"product": "T4"}, {"product": "L4", "maxGpus": 1}]))
    await wait_for("r Running on 6 A10G + 1 T4, its links measured", lambda: (
        s := _status(api, "default", "r")).get("phase") == "Running"
        and (s.get("plan") or {}).get("pools") == {"NVIDIA-A10G": 6, "Tesla-T4": 1}
        and _ranks_running(api, "r", 7)
        and _condition(api, "r", "NetworkMeasured").get("status") == "True")
    before = [name for _, name in replaced.probe_pods]
    assert before, "the first plan measured nothing"
    old = {p["metadata"]["uid"] for p in pods(api, "default", "trainer")}

    await call(api, "PATCH", "/api/v1/nodes/l4-0/status", {"status": {
        "conditions": [{"type": "Ready", "status": "True"}]}})
    await call(api, "PATCH", "/api/v1/nodes/t4-0/status", {"status": {
        "conditions": [{"type": "Ready", "status": "False"}]}})

    def restarted() -> list[dict[str, Any]] | None:
        ranks = _ranks_running(api, "r", 7)
        return ranks if ranks and not {p["metadata"]["uid"] for p in ranks} & old else None

    ranks = await wait_for("r's 7 new ranks Running", restarted, WAIT_SECONDS)
    assert {p["spec"]["nodeName"] for p in ranks} == {"a10g-0", "a10g-1", "l4-0"}
    new = {p["metadata"]["uid"] for p in ranks}

    measured = await wait_for("NetworkMeasured True after the probe beside the gang", lambda: (
        c if (c := _condition(api, "r", "NetworkMeasured")).get("status") == "True"
        and "beside the running gang" in c.get("message", "") else None))
    assert "NVIDIA-A10G <-> NVIDIA-L4" in measured["message"], measured
    # The recovery waited on nothing: every new rank ran before the probe's first pod existed.
    probes = [name for kind, name in replaced.order if kind == "probe" and
              f"default/{name}" not in before]
    assert len(probes) == 2, replaced.order  # one probe: a pod on each side of the link
    first_probe = replaced.order.index(("probe", probes[0]))
    ran = [replaced.order.index(("running", uid)) for uid in new]
    assert max(ran) < first_probe, replaced.order
    # Cached for every job on these pools, in the operator's namespace.
    cached = [NetworkProfile.model_validate_json(cm["data"][NETWORK_PROFILE_KEY])
              for cm in _network_config_maps(api).values()]
    assert any(sorted(p.pools) == ["NVIDIA-A10G", "NVIDIA-L4"] for p in cached), cached
    # The probe never touched the gang: the same ranks run, no restart was counted for it.
    assert _ranks_running(api, "r", 7) and {
        p["metadata"]["uid"] for p in pods(api, "default", "trainer")
        if not p["metadata"].get("deletionTimestamp")} == new
    assert not _status(api, "default", "r").get("restarts")
