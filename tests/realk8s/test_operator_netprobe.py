"""Issue 35 item 1 under the real control plane: the operator (the chart's ServiceAccount and
RBAC, its network probe on) measures the network between the cluster's two GPU nodes with a
real probe gang — two `python -m cephalo.trainer.netprobe` processes the real scheduler
placed on the two nodes (pod anti-affinity), gloo on this machine's loopback — and, the P40
node having two GPUs for this test, the link inside that node with one probe pod of both;
caches both in ConfigMaps, and plans with them (Events `NetworkMeasured`); a second job
reuses them (no probe pod, no Event), and `cephalo status` and `cephalo plan --cluster`
show it.

The session's operator runs with the probe off (every other realk8s test plans as soon as
profiled); this test stops it, runs one with the probe on, and starts it again after."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo.api.network_profile import MEASURED_SOURCE, NETWORK_PROFILE_KEY, NetworkProfile
from cephalo.cli import main as cli_main

from .cluster import NODES, OPERATOR_NAMESPACE, Cluster
from .operator_auth import operator_kubeconfig
from .operator_run import JOB_SECONDS, JOBS, Operator, phases_until, tiny_job
from .rest import wait_until

PAIR = "gpu-p40"  # the node given two GPUs for this test: an intra-node link to measure


@pytest.fixture
def two_gpus_on_one_node(cluster: Cluster) -> Iterator[None]:
    """The P40 node with two GPUs (capacity and the GPU Feature Discovery count) while the
    test runs, as a kubelet whose device plugin found a second GPU would report it; one
    again afterwards, so the other tests see the session's GPUs only."""
    (one,) = [n for n in NODES if n.name == PAIR]

    def set_gpus(node: Any) -> None:
        cluster.heartbeat.nodes[PAIR] = node
        cluster.rest.request("PATCH", f"/api/v1/nodes/{PAIR}", {"metadata": {"labels": {
            "nvidia.com/gpu.count": str(node.gpus)}}}, ctype="application/merge-patch+json")
        cluster.heartbeat.set_ready(PAIR, True)  # beats now: the capacity at once
        wait_until(f"{PAIR} with {node.gpus} GPUs", lambda: (cluster.rest.must(
            "GET", f"/api/v1/nodes/{PAIR}")["status"]["allocatable"].get("nvidia.com/gpu")
            == str(node.gpus)), 30)

    set_gpus(dataclasses.replace(one, gpus=2))
    try:
        yield
    finally:
        set_gpus(one)


@pytest.fixture
def probing(cluster: Cluster, operator_process: Operator, tmp_path: Path,
            on_failure: Callable[[Callable[[], str]], None]) -> Iterator[Operator]:
    operator_process.stop()
    proc = Operator(operator_kubeconfig(cluster), tmp_path / "operator.log",
                    extra_env={"CEPHALO_NETWORK_PROBE": "true",
                               # as the chart's downward API says it: the cache's namespace
                               "CEPHALO_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE})
    on_failure(proc.log)
    try:
        yield proc
    finally:
        proc.stop()
        operator_process.restart()


def _network_config_maps(cluster: Cluster, ns: str = OPERATOR_NAMESPACE
                         ) -> dict[str, NetworkProfile]:
    items = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/configmaps", params={
        "labelSelector": "cephalo.dev/network-profile=true"})["items"]
    return {cm["metadata"]["name"]: NetworkProfile.model_validate_json(
        cm["data"][NETWORK_PROFILE_KEY]) for cm in items}


def _events(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    return cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/events")["items"]


def _reasons(cluster: Cluster, ns: str, name: str) -> list[str]:
    """The reasons of the Events about job `name`."""
    return [e["reason"] for e in _events(cluster, ns)
            if (e.get("involvedObject") or {}).get("name") == name]


def _probe_pods_seen(cluster: Cluster, ns: str, job: str) -> set[str]:
    """Every probe pod of `job` that was ever made: the ones the process kubelet ran and the
    ones the real scheduler posted an Event about (it does for every pod it sees)."""
    prefix = f"{job}-netprobe"
    ran = {c.key.split("/", 1)[1] for c in list(cluster.kubelet.containers.values())
           if c.key.startswith(f"{ns}/{prefix}")}
    return ran | {name for e in _events(cluster, ns)
                  if (name := (e.get("involvedObject") or {}).get("name", "")).startswith(prefix)}


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    (condition,) = [c for c in status["conditions"] if c["type"] == kind]
    return condition


def _finished(cluster: Cluster, ns: str, job: dict[str, object]) -> dict[str, Any]:
    meta = job["metadata"]
    assert isinstance(meta, dict)
    phases, status = phases_until(cluster, ns, meta["name"], meta["resourceVersion"],
                                  {"Succeeded", "Failed"}, JOB_SECONDS)
    assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
    return status


def test_the_network_is_measured_under_the_real_api_server(
        cluster: Cluster, two_gpus_on_one_node: None, probing: Operator, job_namespace: str,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = job_namespace
    for name in _network_config_maps(cluster):  # another run's measurement: measure now
        cluster.rest.request("DELETE",
                             f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/configmaps/{name}")
    started = time.monotonic()
    first = cluster.rest.create(JOBS.format(ns=ns), tiny_job("netp", ns),
                                fieldValidation="Strict")
    status = _finished(cluster, ns, first)
    measured = _network_config_maps(cluster)
    assert not _network_config_maps(cluster, ns)  # the job's namespace holds none
    kinds = {p.kind: p for p in measured.values()}  # one pair of pools, one two-GPU node
    assert len(measured) == 2 and set(kinds) == {"inter-node", "intra-node"}, measured
    profile = kinds["inter-node"]
    assert sorted(profile.pools) == ["NVIDIA-RTX-A6000", "Tesla-P40"]
    assert sorted(profile.nodes) == ["gpu-a6000", PAIR]  # one rank on each node
    assert kinds["intra-node"].pools == ["Tesla-P40"] and kinds["intra-node"].nodes == [PAIR]
    for each in measured.values():  # real measurements of loopback gloo: positive, finite
        assert each.collectives.world_size == 2, each
        assert 0 < each.bandwidth_bytes_per_second < 1e12, each
        assert each.measured_for == first["metadata"]["uid"]  # type: ignore[index]
    # Both probes ran as real processes and rank 0 of each exited 0 (its fit is the cached
    # figure; the other pod of the inter-node gang is deleted once rank 0 is done).
    probes = {c.key: c.proc.returncode for c in list(cluster.kubelet.containers.values())
              if c.key.startswith(f"{ns}/netp-netprobe-") and c.key.endswith("-0")
              and c.proc is not None}
    assert sorted(probes.values()) == [0, 0], probes
    plan = status["plan"]
    assert isinstance(plan, dict) and plan["networkSource"] == MEASURED_SOURCE, plan
    measured_now = _condition(status, "NetworkMeasured")
    assert measured_now["status"] == "True", measured_now
    reasons = _reasons(cluster, ns, "netp")
    assert reasons.count("NetworkMeasured") == 2 and "NetworkAssumed" not in reasons, reasons
    wait_until("netp's probe pods gone", lambda: not cluster.rest.must(  # cleaned up
        "GET", f"/api/v1/namespaces/{ns}/pods", params={
            "labelSelector": "cephalo.dev/job=netp,cephalo.dev/role=netprobe"})["items"],
        JOB_SECONDS)
    assert "forbidden" not in probing.log_text().lower(), probing.log()  # the chart's RBAC
    print(f"realk8s: netp measured {profile.describe()} and trained in "
          f"{time.monotonic() - started:.0f} s")

    # The second job: the cached measurement, no probe pod; the client shows it.
    job_file = tmp_path / "netq.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job("netq", ns)))
    where = ["--namespace", ns, "--kubeconfig", str(cluster.plane.kubeconfig)]
    capsys.readouterr()
    assert cli_main(["plan", "--cluster", "--job", str(job_file), *where]) == 0
    preview = capsys.readouterr()
    shown = preview.out + preview.err
    assert f"network: inter-node {' <-> '.join(profile.pools)}" in shown, shown
    assert MEASURED_SOURCE in shown, shown
    second = cluster.rest.create(JOBS.format(ns=ns), tiny_job("netq", ns),
                                 fieldValidation="Strict")
    status = _finished(cluster, ns, second)
    assert status["plan"]["networkSource"] == MEASURED_SOURCE  # type: ignore[index]
    measured_now = _condition(status, "NetworkMeasured")
    assert measured_now["status"] == "True", measured_now
    assert _network_config_maps(cluster) == measured  # not measured again
    assert "netq: network probe" not in probing.log_text(), probing.log()
    assert not _probe_pods_seen(cluster, ns, "netq")
    assert "NetworkMeasured" not in _reasons(cluster, ns, "netq")
    capsys.readouterr()
    assert cli_main(["status", "netq", *where]) == 0
    details = capsys.readouterr().out
    assert "NetworkMeasured" in details and MEASURED_SOURCE in details, details
    for name in ("netp", "netq"):
        cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/{name}")
    wait_until("the jobs gone", lambda: all(cluster.rest.get(
        f"{JOBS.format(ns=ns)}/{n}").status == 404 for n in ("netp", "netq")), JOB_SECONDS)
