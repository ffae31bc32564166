"""Issue 44, "the operator end to end" under the real control plane: two nodes of two GPUs
whose NICs the cluster labels slow (cephalo.dev/nic-gbps = 0.01), added for this test. A job
on them (its own GPU pool, `ranksPerPod: 0`) is planned hybrid, a replica group per node
(plan.json, status.plan, the Planned Event); the real scheduler places its two rank pods, one
per node, each pointed at the plan ConfigMap's plan.json; each pod's two real trainer
processes (CPU, gloo) read the groups from it and train to Succeeded (every step reported in
status.progress, each container exiting 0). That they trained hybrid is read from what they
wrote: the checkpoint's meta.json names the replica groups the engine ran; every rank writes
its piece. Short: profiles seeded from the catalog (no profiler pod), six steps.

This is the only end-to-end run of a hybrid job: the API emulator's copy of it
(tests/operator/test_operator_hybrid_e2e.py) checked nothing this does not."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from cephalo.api import parse_plan
from cephalo.api.network import NIC_GBPS_LABEL
from cephalo.operator.placement import KUEUE_PREFERRED_TOPOLOGY

from .cluster import Cluster
from .kueue import API, KUEUE_NAMESPACE_LABEL, Kueue
from .nodes import GpuNode
from .operator_run import (
    JOB_SECONDS,
    JOBS,
    Operator,
    make_claim,
    phases_until,
    seed_estimated_profiles,
    tiny_job,
)
from .rest import wait_until

POOL = "NVIDIA-A10G"  # no session node has it: the job runs on this test's nodes alone
HYBRID_NODES = [GpuNode(f"gpu-a10g-{i}", POOL, 2, 23028) for i in range(2)]
# The tiny model: across so slow a NIC flat sharding's gathers cost clearly more (above the
# planner's 5 % margin for hybrid) than the cross-group halves (at 1 Gbit/s a fresh-clone
# CI run planned it flat).
SLOW_NIC_GBPS = "0.01"


def _schedulable(node: dict) -> bool:
    ready = any(c["type"] == "Ready" and c["status"] == "True"
                for c in (node.get("status") or {}).get("conditions", []))
    return ready and not (node.get("spec") or {}).get("taints")


@pytest.fixture(name="two_nodes")
def two_nodes_fixture(cluster: Cluster) -> Iterator[list[GpuNode]]:
    """The two nodes, Ready and run by the process kubelet; gone again afterwards, so the
    other tests see the session's GPUs only."""
    for node in HYBRID_NODES:
        cluster.kubelet.node_names.add(node.name)
        cluster.heartbeat.register(node)
        cluster.rest.request("PATCH", f"/api/v1/nodes/{node.name}",
                             {"metadata": {"labels": {NIC_GBPS_LABEL: SLOW_NIC_GBPS}}},
                             ctype="application/merge-patch+json")
    # Both Ready and untainted before any job: a new node carries the API server's
    # node.kubernetes.io/not-ready:NoSchedule taint until the node lifecycle controller sees
    # it Ready, and the operator (like the scheduler) plans only on nodes that tolerate
    # nothing extra (two fresh-clone CI runs planned world size 2, flat, on the other node).
    for node in HYBRID_NODES:
        wait_until(f"{node.name} Ready and untainted", lambda n=node: _schedulable(
            cluster.rest.must("GET", f"/api/v1/nodes/{n.name}")), 120.0, 0.2)
    try:
        yield HYBRID_NODES
    finally:
        for node in HYBRID_NODES:
            cluster.heartbeat.nodes.pop(node.name, None)
            cluster.rest.request("DELETE", f"/api/v1/nodes/{node.name}")
            cluster.kubelet.node_names.discard(node.name)


def test_a_job_behind_a_slow_link_trains_hybrid_under_the_real_api_server(
        cluster: Cluster, operator: Operator, job_namespace: str,
        two_nodes: list[GpuNode]) -> None:
    ns, name = job_namespace, "hybrid"
    log_from = operator.log_size()
    body = tiny_job(name, ns, ranksPerPod=0, gpuPools=[{"product": POOL}])
    body["spec"]["planner"]["sharding"] = "auto"
    # Every GPU used: the verdict is flat vs hybrid on the same four GPUs (with the choice of
    # GPUs open, the tiny model's best plan may be one node's two GPUs, flat).
    body["spec"]["planner"]["chooseGpus"] = False
    seed_estimated_profiles(cluster, ns, body, [POOL])
    created = cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
    phases, status = phases_until(cluster, ns, name, created["metadata"]["resourceVersion"],
                                  {"Succeeded", "Failed"}, JOB_SECONDS)
    assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
    assert "Profiling" not in phases, phases  # planned from the seeded profile

    # Planned hybrid, a group per node, in the ConfigMap the ranks mount.
    cm = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/configmaps/{name}-plan")
    plan = parse_plan(json.loads(cm["data"]["plan.json"]))
    assert plan.replica_groups == [[0, 1], [2, 3]] and plan.pod_ranks == [2, 2], plan
    assert plan.assumptions["sharding"] == "hybrid", plan.assumptions
    assert (status["plan"]["replicaGroups"], status["plan"]["replicaGroupSize"]) == (2, 2)
    events = [e for e in cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/events")["items"]
              if (e.get("involvedObject") or {}).get("name") == name]
    planned = [e["message"] for e in events if e["reason"] == "Planned"]
    assert planned and "hybrid: 2 replica groups of 2" in planned[-1], planned

    # The real scheduler put one two-GPU pod on each node.
    pods = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods", params={
        "labelSelector": f"cephalo.dev/job={name},cephalo.dev/role=trainer"})["items"]
    assert sorted((p["metadata"]["name"], p["spec"]["nodeName"]) for p in pods) in (
        [(f"{name}-rank-0", "gpu-a10g-0"), (f"{name}-rank-2", "gpu-a10g-1")],
        [(f"{name}-rank-0", "gpu-a10g-1"), (f"{name}-rank-2", "gpu-a10g-0")]), pods
    # Each pod was pointed at that plan.json and ran its two ranks on it, both exiting 0.
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["CEPHALO_PLAN"].endswith("plan.json"), env
        assert env["CEPHALO_RANKS_PER_POD"] == "2", env
        assert pod["status"]["phase"] == "Succeeded", pod["status"]
        assert [c["state"]["terminated"]["exitCode"] for c in
                pod["status"]["containerStatuses"]] == [0], pod["status"]

    # The ranks trained hybrid: meta.json names the groups; every rank wrote its piece of
    # the optimizer state (4 files, docs/hybrid-sharding.md).
    steps = body["spec"]["training"]["steps"]
    progress = status.get("progress") or {}
    assert (progress.get("step"), progress.get("totalSteps")) == (steps, steps), status
    final = cluster.kubelet.claim_folder(ns, "ckpt") / name / f"step-{steps:08d}"
    meta = json.loads((final / "meta.json").read_text())
    assert meta["replica_groups"] == [[0, 1], [2, 3]], meta
    assert sorted(p.name for p in final.glob("rank-*.pt")) == [f"rank-{i:05d}.pt" for i in range(4)]
    assert "forbidden" not in operator.log_text(log_from).lower(), operator.log()
    cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/{name}")
    wait_until("the job's pods gone", lambda: not cluster.rest.must(
        "GET", f"/api/v1/namespaces/{ns}/pods",
        params={"labelSelector": f"cephalo.dev/job={name}"})["items"], JOB_SECONDS)


LEAF = "network.topology.nvidia.com/leaf"  # Topograph's leaf-switch label


def test_real_kueue_places_the_hybrid_gang_as_its_plan_assumes(
        cluster: Cluster, kueue: Kueue, operator: Operator, two_nodes: list[GpuNode],
        on_failure: Callable[[Callable[[], str]], None]) -> None:
    """The same job queued through real Kueue with topology-aware scheduling (a Topology of
    Topograph's leaf label and the hostname, a ResourceFlavor of the two nodes on it): the
    operator (placement.kueueTopologyLevel = the leaf label) asks for the gang in one leaf;
    Kueue's Workload carries the request, Kueue admits it with a topology assignment (a pod
    per node of the leaf) and the job trains to Succeeded there."""
    on_failure(kueue.logs)
    ns, name = cluster.namespace("tas"), "tas"
    cluster.rest.merge_patch(f"/api/v1/namespaces/{ns}",
                             {"metadata": {"labels": {KUEUE_NAMESPACE_LABEL: "true"}}})
    make_claim(cluster, ns, "ckpt")
    for node in two_nodes:
        cluster.rest.merge_patch(f"/api/v1/nodes/{node.name}",
                                 {"metadata": {"labels": {LEAF: "leaf-1"}}})
    made = [f"{API}/topologies/{ns}", f"{API}/resourceflavors/{ns}", f"{API}/clusterqueues/{ns}"]
    cluster.rest.create(f"{API}/topologies", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": ns},
        "spec": {"levels": [{"nodeLabel": LEAF}, {"nodeLabel": "kubernetes.io/hostname"}]}})
    cluster.rest.create(f"{API}/resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
        "metadata": {"name": ns}, "spec": {"nodeLabels": {"nvidia.com/gpu.product": POOL},
                                           "topologyName": ns}})
    cluster.rest.create(f"{API}/clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": ns},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                 "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                                     "flavors": [{"name": ns, "resources": [
                                         {"name": "cpu", "nominalQuota": "64"},
                                         {"name": "memory", "nominalQuota": "256Gi"},
                                         {"name": "nvidia.com/gpu", "nominalQuota": 4}]}]}]}})
    cluster.rest.create(f"{API}/namespaces/{ns}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team"}, "spec": {"clusterQueue": ns}})
    operator.extra_env["CEPHALO_KUEUE_TOPOLOGY_LEVEL"] = LEAF
    operator.restart()
    try:
        body = tiny_job(name, ns, ranksPerPod=0, gpuPools=[{"product": POOL}])
        body["spec"]["planner"]["sharding"] = "auto"
        body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
        seed_estimated_profiles(cluster, ns, body, [POOL])
        created = cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
        phases, status = phases_until(cluster, ns, name, created["metadata"]["resourceVersion"],
                                      {"Succeeded", "Failed"}, JOB_SECONDS)
        assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
        assert status["plan"]["replicaGroups"] == 2, status["plan"]
        pods = [p for p in cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
                if "-rank-" in p["metadata"]["name"]]
        assert len(pods) == 2 and all(
            p["metadata"]["annotations"].get(KUEUE_PREFERRED_TOPOLOGY) == LEAF and
            p["metadata"]["labels"].get("kueue.x-k8s.io/managed") == "true" for p in pods), pods
        gang = [w for w in cluster.rest.must("GET", f"{API}/namespaces/{ns}/workloads")["items"]
                if sum(p["count"] for p in w["spec"]["podSets"]) == 2]
        assert len(gang) == 1, gang
        # Kueue read the request (the pods' shared shape: one PodSet of both) and admitted it
        # with a topology assignment: one pod per node (the lowest level), both in leaf-1.
        requests = [p.get("topologyRequest") or {} for p in gang[0]["spec"]["podSets"]]
        assert [r.get("preferred") for r in requests] == [LEAF], requests
        assigned = [a.get("topologyAssignment") for a in
                    gang[0]["status"]["admission"]["podSetAssignments"]]
        assert assigned and all(a and a["levels"][-1] == "kubernetes.io/hostname"
                                and sum(s["domainCount"] for s in a["slices"]) == 2
                                for a in assigned), assigned
        assert sorted(p["spec"]["nodeName"] for p in pods) == [n.name for n in two_nodes]
        print(f"realk8s: real Kueue admitted the hybrid gang with topology {assigned}")
    finally:
        operator.extra_env.pop("CEPHALO_KUEUE_TOPOLOGY_LEVEL", None)
        operator.restart()
        cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/{name}")
        for path in reversed(made):
            cluster.rest.request("DELETE", path)
