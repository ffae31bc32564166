"""Issue 35 items 1, 4 and 5 end to end: the operator measures the network on the cluster.

The kopf operator process runs against the API emulator with its network probe on; the
process kubelet runs the probe pods it creates as real `python -m cephalo.trainer.netprobe`
processes (two gloo ranks on this machine's loopback), and the first job's rank pods as real
trainers. A job on an L4 node with two GPUs and an A10G node gets an inter-node probe (a
gang of two pods, one per pool) and an intra-node probe (one pod with both L4 GPUs); their
measurements are cached in ConfigMaps of the operator's namespace, the plan says it was
priced over the measured network, and a second job on the same pools measures nothing. A
probe that cannot finish is given up after its timeout (never a hang): the job is planned on
the assumed network and says so (condition, Warning Events)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    WAIT_SECONDS,
    ExtraPassKubelet,
    OperatorProcess,
    Scheduler,
    apply_job,
    apply_nodes,
    finish_profilers,
    free_port,
    job_status,
    pods,
    set_pod,
    wait_for,
)
from operator_harness import NS, events
from process_kubelet import ProcessKubelet

from cephalo.api.network_profile import MEASURED_SOURCE, NETWORK_PROFILE_KEY, NetworkProfile

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # real probe and trainer processes
OPERATOR_NS = "cephalo-system"  # the network cache's namespace (the chart's downward API)
TINY = {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4,
        "ffnHiddenSize": 256, "vocabSize": 256, "sequenceLength": 32}


def _job(name: str) -> dict[str, Any]:
    return job_body(name, model=TINY, globalBatchSize=8,
                    gpuPools=[{"product": "L4"}, {"product": "A10G"}],
                    training={"steps": 3, "learningRate": 1e-3, "schedule": "constant"},
                    data={"synthetic": {}},
                    planner={"chooseGpus": False, "profileMicroBatchSizes": [1, 2],
                             "replan": {"enabled": False}},
                    checkpoint={"claimName": f"ckpt-{name}", "intervalSteps": 1000})


async def _cluster(api: ApiEmulator, tmp_path: Path, jobs: set[str],
                   **env: str) -> tuple[ProcessKubelet, OperatorProcess]:
    await apply_nodes(api, [gpu_node("l4-0", "NVIDIA-L4", 2, 23034),
                            gpu_node("a10g-0", "NVIDIA-A10G", 1, 23028),
                            gpu_node("cpu-0", None, 0)])
    Scheduler(api, run=False)
    kubelet = ProcessKubelet(api, tmp_path / "kubelet", jobs=jobs,
                             metrics_port=free_port()).start()
    operator = OperatorProcess(api.kubeconfig, tmp_path / "operator.log",
                               CEPHALO_TRAINER_METRICS_PORT=str(kubelet.metrics_port),
                               CEPHALO_NETWORK_PROBE="true",
                               CEPHALO_OPERATOR_NAMESPACE=OPERATOR_NS, **env).start()
    return kubelet, operator


@pytest_asyncio.fixture(name="stack")
async def stack_fixture(emulator: ApiEmulator, tmp_path: Path, extra_passes: ExtraPassKubelet
                        ) -> AsyncIterator[tuple[ApiEmulator, ProcessKubelet]]:
    # n1's ranks run as real trainers; n2's only hold their GPUs until the test ends them
    # (what n2 shows is planning on the cached network, not training: n1 trained on it).
    kubelet, operator = await _cluster(emulator, tmp_path, {"n1"})
    try:
        yield emulator, kubelet
    finally:
        await operator.stop()
        await kubelet.stop()
        print(kubelet.logs(), operator.log()[-6000:])  # shown only when the test failed


def _network_profiles(api: ApiEmulator) -> dict[str, NetworkProfile]:
    return {key[3]: NetworkProfile.model_validate_json(cm["data"][NETWORK_PROFILE_KEY])
            for key, cm in list(api._store.items())
            if key[:3] == ("", "configmaps", OPERATOR_NS)
            and key[3].startswith("cephalo-network-")}


async def _succeeded(api: ApiEmulator, name: str) -> dict[str, Any]:
    status = await wait_for(f"{name} finished", lambda: (
        s if (s := job_status(api, NS, name)).get("phase") in ("Succeeded", "Failed")
        else None), WAIT_SECONDS * 2)
    assert status["phase"] == "Succeeded", status.get("message")
    return status


async def test_the_network_is_measured_cached_and_reused(
        stack: tuple[ApiEmulator, ProcessKubelet]) -> None:
    api, kubelet = stack
    first = _job("n1")
    await apply_job(api, first)
    await finish_profilers(api, NS, first, count=2)
    measured = await wait_for("two network profiles", lambda: (
        m if len(m := _network_profiles(api)) == 2 else None), WAIT_SECONDS * 2)
    status = await _succeeded(api, "n1")
    kinds = {p.kind: p for p in measured.values()}
    assert set(kinds) == {"inter-node", "intra-node"}, measured
    assert sorted(kinds["inter-node"].pools) == ["NVIDIA-A10G", "NVIDIA-L4"]
    assert kinds["inter-node"].nodes == ["a10g-0", "l4-0"] or \
        sorted(kinds["inter-node"].nodes) == ["a10g-0", "l4-0"]  # one rank on each node
    assert kinds["intra-node"].pools == ["NVIDIA-L4"] and kinds["intra-node"].nodes == ["l4-0"]
    for profile in measured.values():  # real measurements of loopback gloo: positive, finite
        assert profile.collectives.world_size == 2
        assert 0 < profile.bandwidth_bytes_per_second < 1e12, profile
        assert profile.measured_for == api._store[  # its uid: no job name in the cache
            ("cephalo.dev", "cephalojobs", NS, "n1")]["metadata"]["uid"]
    # Both probes ran as real processes, rank 0 of each exited 0 (its fit is the cached
    # figure; the other pod of the inter-node gang is deleted once rank 0 is done).
    probe_exits = [code for name, code in kubelet.exits if "-netprobe-" in name
                   and name.endswith("-0")]
    assert probe_exits == [0, 0], kubelet.exits
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["NetworkMeasured"]["status"] == "True", conditions["NetworkMeasured"]
    assert status["plan"]["networkSource"] == MEASURED_SOURCE, status["plan"]
    reasons = [r for _, r, _ in events(api, "n1")]
    assert reasons.count("NetworkMeasured") == 2 and "NetworkAssumed" not in reasons, reasons
    assert not pods(api, NS, "netprobe", "n1")  # cleaned up

    # A second job on the same pools: the cached figures, no probe pod at all.
    second = _job("n2")
    await apply_job(api, second)  # (its GPU profiles are cached too: the same model)
    ranks = await wait_for("n2's ranks running", lambda: (
        ps if len(ps := pods(api, NS, "trainer", "n2")) == 3 and all(
            (p.get("status") or {}).get("phase") == "Running" for p in ps) else None))
    for pod in ranks:  # they complete (n1's real trainers trained on this network)
        await set_pod(api, NS, pod["metadata"]["name"], "Succeeded")
    status = await _succeeded(api, "n2")
    assert not [n for _, n in api.created("pods") if n.startswith("n2-netprobe")]
    assert status["plan"]["networkSource"] == MEASURED_SOURCE
    assert {c["type"]: c for c in status["conditions"]}["NetworkMeasured"]["status"] == "True"
    assert "NetworkMeasured" not in [r for _, r, _ in events(api, "n2")]
    assert _network_profiles(api) == measured  # not measured again


async def test_a_probe_that_cannot_finish_is_given_up_and_the_network_assumed(
        emulator: ApiEmulator, tmp_path: Path, extra_passes: ExtraPassKubelet) -> None:
    # The kubelet runs the job's ranks but not its probe pods (they stay Running, as a rank
    # whose peer is unreachable would): the probe is given up after its timeout.
    kubelet, operator = await _cluster(emulator, tmp_path, set(),
                                       CEPHALO_NETWORK_PROBE_TIMEOUT_SECONDS="2")
    try:
        body = _job("g")
        await apply_job(emulator, body)
        await finish_profilers(emulator, NS, body, count=2)
        status = await wait_for("g planned", lambda: (
            s if (s := job_status(emulator, NS, "g")).get("plan") else None), WAIT_SECONDS)
        conditions = {c["type"]: c for c in status["conditions"]}
        measured = conditions["NetworkMeasured"]
        assert measured["status"] == "False" and measured["reason"] == "ProbeFailed", measured
        assert "not done within 2 s" in measured["message"], measured
        assert status["plan"]["networkSource"] == "assumed", status["plan"]
        def warned() -> list[tuple[str, str, str]] | None:
            posted = events(emulator, "g")
            wanted = {"NetworkProbeFailed", "NetworkAssumed"}
            return posted if wanted <= {r for _, r, _ in posted} else None

        posted = await wait_for("the Warning events", warned)
        assert all(t == "Warning" for t, r, _ in posted
                   if r in ("NetworkProbeFailed", "NetworkAssumed")), posted
        assert all(p["metadata"].get("deletionTimestamp")  # given up: being deleted
                   for p in pods(emulator, NS, "netprobe", "g"))
        assert not _network_profiles(emulator)  # nothing cached from a failure
    finally:
        await operator.stop()
        await kubelet.stop()
        print(operator.log()[-6000:])
