"""Issue 12, pure parts: GPU accounting of pods as the scheduler does it, claims of other
Cephalo jobs, toleration matching, free pools, spec.maxGpus (no cluster, no operator)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kube_fixtures import gpu_node, job_body

from cephalo.api import parse_job
from cephalo.operator.discovery import (
    GpuUsage,
    NoGpusError,
    discover_pools,
    job_tolerations,
    select_cluster,
    tolerates,
)
from cephalo.operator.gang_timeout import schedule_timeout_seconds, unscheduled
from cephalo.operator.gpu_usage import (
    Claim,
    GpuClaims,
    PodLister,
    gpu_usage,
    pod_gpu_request,
    slim_pod,
)
from cephalo.operator.handlers import pod_frees_gpus, waiting_for_gpus

GPU = "nvidia.com/gpu"


def _c(requests: dict | None = None, limits: dict | None = None, **extra: Any) -> dict:
    resources = {}
    if requests is not None:
        resources["requests"] = requests
    if limits is not None:
        resources["limits"] = limits
    return {"name": "c", "resources": resources, **extra}


def _pod(containers: list[dict], init: list[dict] | None = None, *, node: str | None = "n",
         phase: str = "Running", owner: str | None = None, job: str | None = None,
         product: str | None = None, name: str = "p") -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": "other", "labels": {}}
    if owner is not None:
        meta["ownerReferences"] = [{"uid": owner, "controller": True, "kind": "CephaloJob"}]
    if job is not None:
        meta["labels"]["cephalo.dev/job"] = job
    spec: dict[str, Any] = {"containers": containers, "initContainers": init or []}
    if node:
        spec["nodeName"] = node
    if product:
        spec["nodeSelector"] = {"nvidia.com/gpu.product": product}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


# ---- what one pod requests -----------------------------------------------------------------
def test_requests_limits_and_init_containers_count_as_the_scheduler_counts() -> None:
    assert pod_gpu_request(_pod([_c({GPU: "2"})])) == 2
    assert pod_gpu_request(_pod([_c(limits={GPU: 3})])) == 3  # a limit implies the request
    assert pod_gpu_request(_pod([_c({GPU: 1}, {GPU: 1}), _c({"cpu": "1"})])) == 1
    assert pod_gpu_request(_pod([_c({GPU: 1}), _c(limits={GPU: 2})])) == 3  # containers add
    # init containers run one at a time: the larger of their peak and the app's sum
    assert pod_gpu_request(_pod([_c({GPU: 1})], [_c({GPU: 4}), _c({GPU: 2})])) == 4
    assert pod_gpu_request(_pod([_c({GPU: 3})], [_c({GPU: 2})])) == 3
    # a sidecar (restartPolicy Always) keeps running beside the app containers
    sidecar = _c({GPU: 1}, restartPolicy="Always")
    assert pod_gpu_request(_pod([_c({GPU: 2})], [sidecar, _c({GPU: 2})])) == 3
    assert pod_gpu_request(_pod([_c({"cpu": "2"}, {"memory": "1Gi"})])) == 0
    assert pod_gpu_request(slim_pod(_pod([_c(limits={GPU: 3})], [_c({GPU: 5})]))) == 5


def test_terminal_pods_and_own_pods_do_not_count() -> None:
    nodes = [gpu_node("n", "Tesla-T4", 4)]
    pods = [_pod([_c({GPU: 1})], phase="Succeeded", name="done"),
            _pod([_c({GPU: 1})], phase="Failed", name="failed"),
            _pod([_c({GPU: 1})], phase="Pending", name="bound-pending"),  # bound: counts
            _pod([_c({GPU: 1})], phase="Unknown", name="lost"),
            _pod([_c({GPU: 1})], owner="me", job="mine", name="own-rank"),
            _pod([_c({GPU: 2})], node=None, phase="Pending", name="foreign-unbound")]
    usage = gpu_usage(pods, "me", [], nodes)
    assert usage == GpuUsage(used_by_node={"n": 2}, reserved_by_pool={})
    assert [p.num_gpus for p in discover_pools(nodes, usage).pools] == [2]


# ---- other Cephalo jobs' plans ----------------------------------------------------------------
def test_a_growing_jobs_profiler_gpu_stays_held_whatever_its_claim_becomes() -> None:
    """Issue 39 item 1: an elastic job profiling a freed pool holds one GPU of it for the
    profiler, apart from its claim (which every pass and job event set to its plan)."""
    nodes = [gpu_node("a", "NVIDIA-A10G", 4), gpu_node("t", "Tesla-T4", 4)]
    claims = GpuClaims()
    claims.claim(("ns", "b"), "uid-b", {"NVIDIA-A10G": 4})
    claims.hold_profiler(("ns", "b"), "uid-b", "Tesla-T4")
    claims.claim(("ns", "b"), "uid-b", {"NVIDIA-A10G": 4, "Tesla-T4": 2})  # b's offer claimed
    usage = gpu_usage([], "uid-a", claims.others("uid-a"), nodes)
    assert usage.reserved_by_pool == {"NVIDIA-A10G": 4, "Tesla-T4": 3}  # claim + profiler
    claims.observe(("ns", "b"), "uid-b", {"phase": "Running", "plan": {"pools": {
        "NVIDIA-A10G": 4}}, "conditions": [{"type": "Planned", "status": "True"}]})
    usage = gpu_usage([], "uid-a", claims.others("uid-a"), nodes)
    assert usage.reserved_by_pool == {"NVIDIA-A10G": 4, "Tesla-T4": 1}
    assert gpu_usage([], "uid-b", claims.others("uid-b"), nodes).reserved_by_pool == {}
    assert claims.release_profiler(("ns", "b")) and not claims.release_profiler(("ns", "b"))
    claims.hold_profiler(("ns", "b"), "uid-b", "Tesla-T4")
    assert claims.observe(("ns", "b"), "uid-b", {"phase": "Succeeded"})  # finished: all freed
    assert claims.others("uid-a") == []


def test_planned_but_unbound_gpus_of_other_jobs_are_reserved_once() -> None:
    nodes = [gpu_node("a", "NVIDIA-A10G", 4), gpu_node("t", "Tesla-T4", 4)]
    other = Claim("uid-b", {"NVIDIA-A10G": 3, "Tesla-T4": 1})
    pods = [  # job b: one rank bound on a (per node), one Pending pinned to the A10G pool
        _pod([_c({GPU: 1})], node="a", owner="uid-b", job="b", product="NVIDIA-A10G",
             name="b-rank-0"),
        _pod([_c({GPU: 1})], node=None, phase="Pending", owner="uid-b", job="b",
             product="NVIDIA-A10G", name="b-rank-1"),
        # job c: no claim seen by this process yet (an operator restart): its pinned pods count
        _pod([_c({GPU: 1})], node=None, phase="Pending", owner="uid-c", job="c",
             product="Tesla-T4", name="c-profile")]
    usage = gpu_usage(pods, "uid-a", [other, Claim("uid-a", {"Tesla-T4": 4})], nodes)
    # A10G: b claims 3, 1 of them bound (counted on node a) → 2 more reserved; T4: b 1 + c 1
    assert usage == GpuUsage(used_by_node={"a": 1},
                             reserved_by_pool={"NVIDIA-A10G": 2, "Tesla-T4": 2})
    pools = discover_pools(nodes, usage).pools
    assert [(p.product, p.num_gpus) for p in pools] == [("NVIDIA-A10G", 1), ("Tesla-T4", 2)]
    # everything taken: the pool is gone, and the message says why
    full = discover_pools(nodes, GpuUsage({"a": 4}, {"Tesla-T4": 4}))
    assert full.pools == []
    assert "a: all 4 nvidia.com/gpu requested by other pods" in full.unusable
    assert any("Tesla-T4: all 4 free GPU(s) planned by other Cephalo jobs" in u
               for u in full.unusable)


def test_claims_follow_the_job_status() -> None:
    claims = GpuClaims()
    claims.claim(("ns", "a"), "uid-a", {"NVIDIA-A10G": 2, "Tesla-T4": 0})
    assert claims.others("uid-b") == [Claim("uid-a", {"NVIDIA-A10G": 2})]
    assert claims.others("uid-a") == []
    # Planning keeps the pass's own claim (the old plan's pools must not come back)
    claims.observe(("ns", "a"), "uid-a", {"phase": "Planning", "plan": {"pools": {"x": 9}}})
    assert claims.claims[("ns", "a")].pools == {"NVIDIA-A10G": 2}
    planned = [{"type": "Planned", "status": "True"}]
    claims.observe(("ns", "b"), "uid-b", {"phase": "Running", "conditions": planned,
                                          "plan": {"pools": {"Tesla-T4": 3}}})
    assert claims.claims[("ns", "b")] == Claim("uid-b", {"Tesla-T4": 3})  # after a restart
    # waiting for GPUs after its GPUs were lost: the old plan in status is not held
    claims.observe(("ns", "c"), "uid-c", {"phase": "Pending", "plan": {"pools": {"x": 1}},
                                          "conditions": [{"type": "Planned", "status": "False"}]})
    assert ("ns", "c") not in claims.claims
    for status in ({"phase": "Succeeded"}, {"phase": "Failed"}, {"phase": "Suspended"}):
        claims.claim(("ns", "a"), "uid-a", {"NVIDIA-A10G": 2})
        assert claims.observe(("ns", "a"), "uid-a", status)  # GPUs freed: wake the waiting
        assert ("ns", "a") not in claims.claims
        assert not claims.observe(("ns", "a"), "uid-a", status)  # nothing held any more
    assert claims.observe(("ns", "b"), "uid-b", {"phase": "Running"}, deleted=True)
    assert claims.claims == {} and claims.namespaces == {"ns"}


def _gpu_pod(uid: str, gpus: int, phase: str) -> dict[str, Any]:
    return {"metadata": {"uid": uid}, "status": {"phase": phase},
            "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def test_a_gpu_pod_frees_its_gpus_once() -> None:
    ended: set[str] = set()
    assert not pod_frees_gpus("MODIFIED", _gpu_pod("a", 1, "Running"), ended)
    assert pod_frees_gpus("MODIFIED", _gpu_pod("a", 1, "Succeeded"), ended)
    assert not pod_frees_gpus("MODIFIED", _gpu_pod("a", 1, "Succeeded"), ended)  # once
    assert not pod_frees_gpus("DELETED", _gpu_pod("a", 1, "Succeeded"), ended)  # already
    assert ended == set()
    assert pod_frees_gpus("DELETED", _gpu_pod("b", 2, "Running"), ended)  # deleted running
    assert not pod_frees_gpus("MODIFIED", _gpu_pod("c", 0, "Failed"), ended)  # no GPUs


def test_waiting_for_gpus_reads_the_condition() -> None:
    no = [{"type": "GpusAvailable", "status": "False"}]
    assert waiting_for_gpus({"phase": "Pending", "conditions": no})
    assert not waiting_for_gpus({"phase": "Failed", "conditions": no})
    assert not waiting_for_gpus({"phase": "Pending", "conditions": [
        {"type": "GpusAvailable", "status": "True"}]})


# ---- taints and tolerations -------------------------------------------------------------------
@pytest.mark.parametrize(("toleration", "taint", "expected"), [
    ({"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"},
     {"key": "k", "value": "v", "effect": "NoSchedule"}, True),
    ({"key": "k", "value": "v"}, {"key": "k", "value": "v", "effect": "NoExecute"}, True),
    ({"key": "k", "value": "w"}, {"key": "k", "value": "v", "effect": "NoSchedule"}, False),
    ({"key": "k", "operator": "Exists"}, {"key": "k", "value": "v", "effect": "NoSchedule"}, True),
    ({"key": "k", "operator": "Exists", "effect": "NoExecute"},
     {"key": "k", "effect": "NoSchedule"}, False),
    ({"operator": "Exists"}, {"key": "anything", "value": "x", "effect": "NoExecute"}, True),
    ({"key": "other", "operator": "Exists"}, {"key": "k", "effect": "NoSchedule"}, False),
    ({"key": "k", "operator": "Equal"}, {"key": "k", "effect": "NoSchedule"}, True),  # "" == ""
])
def test_toleration_matching_follows_kubernetes(toleration: dict, taint: dict,
                                                expected: bool) -> None:
    assert tolerates(toleration, taint) is expected


def _tainted(name: str, product: str, gpus: int, *taints: dict) -> dict:
    node = gpu_node(name, product, gpus)
    node["spec"]["taints"] = list(taints)
    return node


def test_tainted_gpu_nodes_are_used_only_when_tolerated() -> None:
    nodes = [gpu_node("a", "NVIDIA-A10G", 2),
             _tainted("t", "Tesla-T4", 4, {"key": "team", "value": "ml", "effect": "NoSchedule"}),
             _tainted("p", "Tesla-P40", 1, {"key": "x", "effect": "PreferNoSchedule"}),
             _tainted("g", "NVIDIA-L4", 1, {"key": GPU, "effect": "NoExecute"})]
    plain = parse_job(job_body("plain")).spec
    found = discover_pools(nodes, tolerations=job_tolerations(plain))
    assert [p.product for p in found.pools] == ["NVIDIA-A10G", "Tesla-P40"]
    assert "t: tainted team:NoSchedule (not tolerated)" in found.unusable
    assert "g: tainted nvidia.com/gpu:NoExecute (not tolerated)" in found.unusable
    tolerant = parse_job(job_body("tolerant", podTemplate={"tolerations": [
        {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]})).spec
    found = discover_pools(nodes, tolerations=job_tolerations(tolerant))
    assert [p.product for p in found.pools] == ["NVIDIA-A10G", "Tesla-P40", "Tesla-T4"]
    everything = parse_job(job_body("all", podTemplate={"tolerations": [
        {"operator": "Exists"}]})).spec
    assert len(discover_pools(nodes, tolerations=job_tolerations(everything)).pools) == 4


# ---- caps ---------------------------------------------------------------------------------------
NODES = [gpu_node("a", "NVIDIA-A10G", 4, 23028), gpu_node("t", "Tesla-T4", 4, 15360),
         gpu_node("v", "Tesla-V100-SXM2-16GB", 2, 16384)]


def _groups(**spec: Any) -> list[tuple[str, int]]:
    job = parse_job(job_body("cap", **spec)).spec
    cluster, _ = select_cluster(job, discover_pools(NODES), NODES)
    return [(g.pool, g.count) for g in cluster.groups]


def test_job_max_gpus_keeps_the_fastest_gpus() -> None:
    assert sum(n for _, n in _groups()) == 10
    # fp32: A10G 31.2 TFLOPS, V100 15.7, T4 8.1 → the T4s go first
    assert _groups(maxGpus=6) == [("NVIDIA-A10G", 4), ("Tesla-V100-SXM2-16GB", 2)]
    assert _groups(maxGpus=5) == [("NVIDIA-A10G", 4), ("Tesla-V100-SXM2-16GB", 1)]
    assert _groups(maxGpus=3) == [("NVIDIA-A10G", 3)]
    assert _groups(maxGpus=100) == [("NVIDIA-A10G", 4), ("Tesla-T4", 4),
                                    ("Tesla-V100-SXM2-16GB", 2)]
    # with pool caps too: never more than either says
    assert _groups(maxGpus=5, gpuPools=[{"product": "T4", "maxGpus": 3},
                                        {"product": "A10G", "maxGpus": 1}]) == [
        ("Tesla-T4", 3), ("NVIDIA-A10G", 1)]
    assert _groups(maxGpus=2, gpuPools=[{"product": "T4", "maxGpus": 3},
                                        {"product": "A10G", "maxGpus": 1}]) == [
        ("Tesla-T4", 1), ("NVIDIA-A10G", 1)]


def test_caps_apply_to_free_gpus_and_narrowed_pools() -> None:
    usage = GpuUsage({"a": 3}, {"Tesla-T4": 1})
    job = parse_job(job_body("cap", maxGpus=4)).spec
    cluster, _ = select_cluster(job, discover_pools(NODES, usage), NODES)
    assert [(g.pool, g.count) for g in cluster.groups] == [
        ("NVIDIA-A10G", 1), ("Tesla-T4", 1), ("Tesla-V100-SXM2-16GB", 2)]
    narrowed = parse_job(job_body("n", gpuPools=[
        {"product": "A10G", "nodeSelector": {"kubernetes.io/hostname": "a"}}])).spec
    cluster, _ = select_cluster(narrowed, discover_pools(NODES, usage), NODES)
    assert [(g.pool, g.count) for g in cluster.groups] == [("NVIDIA-A10G", 1)]
    with pytest.raises(NoGpusError, match=r"all 4 nvidia\.com/gpu requested by other pods"):
        select_cluster(narrowed, discover_pools(NODES, GpuUsage({"a": 4})), NODES)


# ---- the pod LIST and the pending timeout's scope -------------------------------------------
class _Kube:
    def __init__(self, items: list[dict]) -> None:
        self.items, self.paths = items, []

    async def list(self, path: str, label_selector: str | None = None,
                   keep: Any = None) -> list[dict]:
        self.paths.append(path)
        kept = [keep(i) if keep else i for i in self.items]
        return [i for i in kept if i is not None]


@pytest.mark.asyncio
async def test_pod_list_scope_filter_and_sharing() -> None:
    now = [100.0]
    lister = PodLister(clock=lambda: now[0], max_age_seconds=10.0)
    kube = _Kube([_pod([_c({GPU: 1})], name="gpu"), _pod([_c({"cpu": "1"})], name="cpu"),
                  _pod([_c({GPU: 1})], phase="Succeeded", name="done")])
    got = await lister.pods(kube, {"team-a"})  # type: ignore[arg-type]
    assert [p["metadata"]["name"] for p in got] == ["gpu"]  # only what can hold a GPU
    assert kube.paths == ["/api/v1/pods?fieldSelector=status.phase%21%3DSucceeded%2C"
                          "status.phase%21%3DFailed"]
    now[0] += 9.0
    await lister.pods(kube, {"team-b"})  # type: ignore[arg-type]
    assert len(kube.paths) == 1  # shared within max_age_seconds
    now[0] += 2.0
    await lister.pods(kube, {"team-b"})  # type: ignore[arg-type]
    assert len(kube.paths) == 2
    namespaced = PodLister(clock=lambda: now[0])
    namespaced.clusterwide = False  # kopf -n: only what a namespaced Role can read
    await namespaced.pods(kube, {"team-b", "team-a"})  # type: ignore[arg-type]
    assert [p.split("?")[0] for p in kube.paths[2:]] == [
        "/api/v1/namespaces/team-a/pods", "/api/v1/namespaces/team-b/pods"]
    await namespaced.pods(kube, {"team-c"})  # type: ignore[arg-type]
    assert kube.paths[-1].startswith("/api/v1/namespaces/team-c/pods?")  # a new namespace


def test_pending_timeout_only_without_a_gang_scheduler() -> None:
    def timeout(labels: dict | None = None, **policy: object) -> int | None:
        body = job_body("t", schedulingPolicy=policy)
        body["metadata"]["labels"] = labels or {}
        return schedule_timeout_seconds(SimpleNamespace(job=parse_job(body)))  # type: ignore

    assert timeout() is None  # unset: ranks wait as long as the scheduler decides
    assert timeout(scheduleTimeoutSeconds=30) == 30
    assert timeout(scheduleTimeoutSeconds=30, schedulerName="my-scheduler") == 30
    assert timeout(scheduleTimeoutSeconds=30, schedulerName="volcano") is None
    assert timeout({"kueue.x-k8s.io/queue-name": "q"}, scheduleTimeoutSeconds=30) is None
    pending = {"metadata": {}, "spec": {}, "status": {"phase": "Pending"}}
    assert unscheduled(pending)
    assert not unscheduled({**pending, "spec": {"nodeName": "n"}})  # bound, not yet running
    assert not unscheduled({**pending, "metadata": {"deletionTimestamp": "x"}})
    assert not unscheduled({**pending, "status": {"phase": "Running"}})

