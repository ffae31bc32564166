"""Real Kueue (sigs.k8s.io/kueue, built by scripts/kueue-binary.sh) admits a CephaloJob's
pods under the real API server: a LocalQueue on a ClusterQueue with two ResourceFlavors (the
A6000 node's and the P40 node's GPU product labels). The job names the queue in its
`kueue.x-k8s.io/queue-name` label; the operator renders its plain pods as the Kueue docs ask
(operator/gang.py), Kueue's own webhook gates them, its controllers make Workloads and admit
them against the quota, and the real scheduler places what Kueue ungated. Checked: with no
P40 in the quota, Kueue admits the A6000's profiler (it runs, its profile is cached) while it
holds the P40's behind its gate, unplaced; once the quota has room the job trains to
Succeeded; its two-rank gang was one Workload whose two pod sets Kueue assigned one to each
flavor (the rank pod for each GPU product to the flavor of that product); every rank
pod was Kueue's (its webhook's `kueue.x-k8s.io/managed` label)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cluster import Cluster
from .kueue import API, KUEUE_NAMESPACE_LABEL, Kueue
from .operator_run import (
    JOB_SECONDS,
    JOBS,
    Operator,
    cached_profiles,
    make_claim,
    phases_until,
    tiny_job,
)
from .rest import wait_until

FLAVORS = {"a6000": "NVIDIA-RTX-A6000", "p40": "Tesla-P40"}  # tests/realk8s/cluster.py NODES
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GATE = "kueue.x-k8s.io/admission"


def _resource_groups(ns: str, gpus: dict[str, int]) -> list[dict[str, Any]]:
    """One group over the pods' resources (Kueue admits only what the queue covers): each
    flavor room for CPU and memory requests and `gpus[flavor]` GPUs."""
    return [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
             "flavors": [{"name": f"{ns}-{name}", "resources": [
                 {"name": "cpu", "nominalQuota": "64"},
                 {"name": "memory", "nominalQuota": "256Gi"},
                 {"name": "nvidia.com/gpu", "nominalQuota": gpus[name]}]} for name in FLAVORS]}]


def _queues(cluster: Cluster, ns: str, gpus: dict[str, int]) -> list[str]:
    """Two flavors, a ClusterQueue over them, a LocalQueue `team` in `ns`; the
    cluster-scoped objects' paths, for the clean-up."""
    made = []
    for name, product in FLAVORS.items():
        made.append(f"{API}/resourceflavors/{ns}-{name}")
        cluster.rest.create(f"{API}/resourceflavors", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
            "metadata": {"name": f"{ns}-{name}"},
            "spec": {"nodeLabels": {"nvidia.com/gpu.product": product}}})
    made.append(f"{API}/clusterqueues/{ns}")
    cluster.rest.create(f"{API}/clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": ns},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                 "resourceGroups": _resource_groups(ns, gpus)}})
    cluster.rest.create(f"{API}/namespaces/{ns}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
        "metadata": {"name": "team"}, "spec": {"clusterQueue": ns}})
    wait_until(f"ClusterQueue {ns} Active", lambda: any(
        c["type"] == "Active" and c["status"] == "True" for c in (cluster.rest.get(
            f"{API}/clusterqueues/{ns}").body.get("status") or {}).get("conditions") or []), 60)
    return made


def _gated(cluster: Cluster, ns: str) -> list[str]:
    """The pods in `ns` Kueue holds behind its scheduling gate (none of them placed)."""
    return [p["metadata"]["name"] for p in cluster.rest.must(
        "GET", f"/api/v1/namespaces/{ns}/pods")["items"]
        if {"name": KUEUE_GATE} in (p["spec"].get("schedulingGates") or [])
        and not p["spec"].get("nodeName")]


def test_real_kueue_admits_the_gang_on_two_resource_flavors(
        cluster: Cluster, kueue: Kueue, operator: Operator,
        on_failure: Callable[[Callable[[], str]], None]) -> None:
    on_failure(kueue.logs)
    ns = cluster.namespace("kueue")
    cluster.rest.merge_patch(f"/api/v1/namespaces/{ns}",
                             {"metadata": {"labels": {KUEUE_NAMESPACE_LABEL: "true"}}})
    make_claim(cluster, ns, "ckpt")
    # No P40 in the quota at first: Kueue must hold the P40's pods (its profiler first).
    made = _queues(cluster, ns, {"a6000": 1, "p40": 0})
    job = tiny_job("queued", ns)
    job["metadata"]["labels"] = {QUEUE_LABEL: "team"}
    try:
        first = cluster.rest.create(JOBS.format(ns=ns), job, fieldValidation="Strict")
        wait_until("the A6000 profiled (its profiler admitted on the a6000 flavor)", lambda: [
            n for n in cached_profiles(cluster, ns) if "rtx-a6000" in n], JOB_SECONDS)
        held = _gated(cluster, ns)
        assert held == ["queued-profile-tesla-p40-0"], held
        phase = (cluster.rest.must("GET", f"{JOBS.format(ns=ns)}/queued").get("status") or {}
                 ).get("phase")
        assert phase == "Profiling", phase
        cluster.rest.merge_patch(f"{API}/clusterqueues/{ns}", {"spec": {
            "resourceGroups": _resource_groups(ns, {"a6000": 1, "p40": 1})}})
        phases, status = phases_until(cluster, ns, "queued", first["metadata"]["resourceVersion"],
                                      {"Succeeded", "Failed"}, JOB_SECONDS)
        assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
        workloads: list[dict[str, Any]] = cluster.rest.must(
            "GET", f"{API}/namespaces/{ns}/workloads")["items"]
        gangs = [w for w in workloads if sum(p["count"] for p in w["spec"]["podSets"]) == 2]
        assert len(gangs) == 1, [w["metadata"]["name"] for w in workloads]
        gang = gangs[0]
        flavors = sorted(a["flavors"]["nvidia.com/gpu"]
                         for a in gang["status"]["admission"]["podSetAssignments"])
        assert flavors == [f"{ns}-a6000", f"{ns}-p40"], gang["status"]
        # Kueue marks the workload Finished once it sees the gang's pods succeed: after the
        # job's Succeeded, on its own clock (a fresh-clone CI run read it a moment before).
        path = f"{API}/namespaces/{ns}/workloads/{gang['metadata']['name']}"

        def finished() -> bool:
            conditions = cluster.rest.must("GET", path)["status"].get("conditions") or []
            return any(c["type"] == "Finished" and c["status"] == "True" for c in conditions)

        wait_until(f"Kueue's Finished condition on workload {gang['metadata']['name']}",
                   finished, JOB_SECONDS)
        pods = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
        ranks = [p for p in pods if "-rank-" in p["metadata"]["name"]]
        assert len(ranks) == 2, [p["metadata"]["name"] for p in pods]
        for pod in ranks:
            assert pod["metadata"]["labels"].get("kueue.x-k8s.io/managed") == "true", pod
            assert not pod["spec"].get("schedulingGates"), pod["spec"]
        print(f"realk8s: real Kueue held {held} until the P40 quota came, then admitted the "
              f"gang {gang['metadata']['name']} on flavors {flavors}; job {' -> '.join(phases)}")
    finally:
        cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/queued")
        for path in made:
            cluster.rest.request("DELETE", path)
