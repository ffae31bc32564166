"""GPUs that other workloads hold, so that a job plans only on free GPUs.

Discovery (cephalo.operator.discovery) subtracts two things from each pool:

* **bound pods** — every non-terminal pod (phase not Succeeded/Failed) bound to a node
  (`spec.nodeName`) that is not this job's own, with the `nvidia.com/gpu` it requests counted
  as the scheduler counts it (`pod_gpu_request`). A job re-planning does not subtract its own
  rank and profiler pods (they are replaced), but does subtract a namesake's (another uid).
* **planned, not yet bound** — GPUs another Cephalo job has chosen but whose pods are not on a
  node yet (profiling, planning, or pods Pending). The default scheduler reserves nothing for
  a Pending pod, so without this two jobs reconciling at the same moment would both take the
  same free GPUs. Every job's choice is recorded in `CLAIMS` (GPUs per pool): when a pass
  selects its GPUs (`claim`, in the same event-loop step that computed what was free, so
  no other pass can interleave), on every pass of a planned job, and from every job's
  `status.plan.pools` seen by the job watch (`observe`: an operator restart loses nothing
  the statuses hold). A job's reservation in a pool is its claim there less its pods already
  bound there (those are counted per node), and at least its own unbound pods pinned to that
  pool by their nodeSelector (a job whose claim this process has not seen yet).

Unbound pods of other workloads are not subtracted (the scheduler does not reserve for them
either). One pod LIST serves the passes of the next `PodLister.max_age_seconds` (the
operator's recheck period) that only look (a job waiting for GPUs, one re-claiming what it
holds while it profiles); a pass that is about to claim GPUs it does not hold yet, or to
solve its plan, lists again (`fresh`): a foreign pod placed within the window was planned
on, and its ranks there stayed Pending until the pending timeout (issue 39 item 2).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from cephalo.operator.discovery import (
    GPU_RESOURCE,
    PRODUCT_LABEL,
    Discovery,
    GpuUsage,
    discover_pools,
)
from cephalo.operator.kube import AsyncKube, controller_uid, core_path
from cephalo.operator.render import LABEL_JOB
from cephalo.operator.status import PLANNED, TERMINAL_PHASES, JobPhase

TERMINAL_POD_PHASES = frozenset({"Succeeded", "Failed"})
NOT_TERMINAL = "status.phase!=Succeeded,status.phase!=Failed"  # the same, server-side

JobKey = tuple[str, str]  # (namespace, name)


def _quantity(value: Any) -> int:
    """An extended resource is a whole number ("1", 2); anything else counts as 0."""
    try:
        return max(0, int(str(value)))
    except (TypeError, ValueError):
        return 0


def container_gpus(container: dict[str, Any]) -> int:
    """The container's GPU request; for extended resources a limit alone implies an equal
    request (Kubernetes defaults requests to limits, and they must be equal)."""
    resources = container.get("resources") or {}
    requests = resources.get("requests") or {}
    if GPU_RESOURCE in requests:
        return _quantity(requests[GPU_RESOURCE])
    return _quantity((resources.get("limits") or {}).get(GPU_RESOURCE))


def pod_gpu_request(pod: dict[str, Any]) -> int:
    """GPUs the scheduler reserves for a pod (its effective request): the larger of the app
    containers' sum and the init-container peak (init containers run one at a time), sidecars
    (init containers with restartPolicy Always) adding to both from where they start, plus
    the RuntimeClass overhead."""
    spec = pod.get("spec") or {}
    sidecars = init_peak = 0
    for init in spec.get("initContainers") or []:
        gpus = container_gpus(init)
        if init.get("restartPolicy") == "Always":
            sidecars += gpus  # keeps running beside everything started after it
            init_peak = max(init_peak, sidecars)
        else:
            init_peak = max(init_peak, sidecars + gpus)
    app = sum(container_gpus(c) for c in spec.get("containers") or []) + sidecars
    return max(app, init_peak) + _quantity((spec.get("overhead") or {}).get(GPU_RESOURCE))


def holds_gpus(pod: dict[str, Any]) -> bool:
    """Not terminal: a Pending, Running or Unknown pod, terminating ones included (the
    scheduler counts a pod's resources until it is gone)."""
    return (pod.get("status") or {}).get("phase") not in TERMINAL_POD_PHASES


@dataclass(frozen=True)
class Claim:
    uid: str
    pools: dict[str, int]  # GPUs per pool (product label)


@dataclass
class GpuClaims:
    """GPUs each active Cephalo job has chosen, per pool (see the module docstring)."""

    claims: dict[JobKey, Claim] = field(default_factory=dict)
    # The GPU an elastic Running job's profiler measures a pool on before it decides to
    # grow there (rescale.py): held apart from `claims`, which every pass of a planned job
    # and every job event set to its plan's pools.
    profilers: dict[JobKey, Claim] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)  # of every job seen (namespaced RBAC)

    def claim(self, key: JobKey, uid: str, pools: Mapping[str, int]) -> None:
        self.namespaces.add(key[0])
        self.claims[key] = Claim(uid, {p: n for p, n in sorted(pools.items()) if n > 0})

    def release(self, key: JobKey) -> bool:
        """Forget the job's reservation; True when it held GPUs (now free for others)."""
        profiler = self.profilers.pop(key, None)
        claim = self.claims.pop(key, None)
        return profiler is not None or (claim is not None and bool(claim.pools))

    def hold_profiler(self, key: JobKey, uid: str, pool: str) -> None:
        """One GPU of `pool` for the job's profiler, until `release_profiler`."""
        self.profilers[key] = Claim(uid, {pool: 1})

    def release_profiler(self, key: JobKey) -> bool:
        return self.profilers.pop(key, None) is not None

    def observe(self, key: JobKey, uid: str | None, status: Mapping[str, Any],
                deleted: bool = False) -> bool:
        """A job event: finished, suspended or deleted jobs hold nothing; a planned job
        (condition Planned True) holds its plan's pools. Otherwise (profiling, planning,
        re-planning, waiting for GPUs) the claim is what the job's own pass decided: its
        status.plan may be an old plan it no longer holds. True: a reservation ended here."""
        self.namespaces.add(key[0])
        phase = status.get("phase")
        if deleted or phase in TERMINAL_PHASES or phase == JobPhase.SUSPENDED:
            return self.release(key)
        planned = any(c.get("type") == PLANNED and c.get("status") == "True"
                      for c in status.get("conditions") or [])
        pools = (status.get("plan") or {}).get("pools")
        if pools and uid and planned and phase not in (JobPhase.PLANNING, JobPhase.PROFILING):
            self.claim(key, uid, {str(p): int(n) for p, n in pools.items()})
        return False

    def holds(self, key: JobKey, uid: str, pools: Mapping[str, int]) -> bool:
        """The job's claim is already exactly `pools` (claiming them again is no new claim)."""
        held = self.claims.get(key)
        return held is not None and held.uid == uid and held.pools == {
            p: n for p, n in sorted(pools.items()) if n > 0}

    def others(self, uid: str) -> list[Claim]:
        return [c for c in (*self.claims.values(), *self.profilers.values()) if c.uid != uid]


def gpu_usage(pods: Iterable[dict[str, Any]], job_uid: str, claims: Iterable[Claim],
              nodes: Iterable[dict[str, Any]]) -> GpuUsage:
    """What job `job_uid` must not plan on (pure; see the module docstring)."""
    product_of = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}).get(PRODUCT_LABEL)
                  for n in nodes}
    used: dict[str, int] = {}
    bound: dict[tuple[str, str], int] = {}  # (job uid, pool) → GPUs on nodes
    pinned: dict[tuple[str, str], int] = {}  # (job uid, pool) → GPUs of unbound pods
    for pod in pods:
        gpus = pod_gpu_request(pod) if holds_gpus(pod) else 0
        owner = controller_uid(pod)
        if gpus <= 0 or owner == job_uid:
            continue
        cephalo = owner is not None and LABEL_JOB in (pod["metadata"].get("labels") or {})
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        if node:
            used[node] = used.get(node, 0) + gpus
            if cephalo and (pool := product_of.get(node)):
                bound[(owner, pool)] = bound.get((owner, pool), 0) + gpus  # type: ignore[index]
        elif cephalo and (pool := (spec.get("nodeSelector") or {}).get(PRODUCT_LABEL)):
            pinned[(owner, pool)] = pinned.get((owner, pool), 0) + gpus  # type: ignore[index]
    planned: dict[tuple[str, str], int] = {}  # a job's claim and its profiler's add up
    for c in claims:
        for pool, n in c.pools.items():
            if c.uid != job_uid:
                planned[(c.uid, pool)] = planned.get((c.uid, pool), 0) + n
    reserved: dict[str, int] = {}
    for owner, pool in sorted(set(planned) | set(pinned)):
        waiting = max(planned.get((owner, pool), 0) - bound.get((owner, pool), 0),
                      pinned.get((owner, pool), 0))
        if waiting > 0:
            reserved[pool] = reserved.get(pool, 0) + waiting
    return GpuUsage(used_by_node=dict(sorted(used.items())), reserved_by_pool=reserved)


def slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """What gpu_usage reads of a pod (a cluster's pods are many: keep little of each)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    labels = meta.get("labels") or {}
    return {"metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                         "labels": {LABEL_JOB: labels[LABEL_JOB]} if LABEL_JOB in labels else {},
                         "ownerReferences": [r for r in meta.get("ownerReferences") or []
                                             if r.get("controller")]},
            "spec": {"nodeName": spec.get("nodeName"),
                     "nodeSelector": {k: v for k, v in (spec.get("nodeSelector") or {}).items()
                                      if k == PRODUCT_LABEL},
                     "overhead": spec.get("overhead"),
                     "initContainers": [_slim_container(c) for c in
                                        spec.get("initContainers") or []],
                     "containers": [_slim_container(c) for c in spec.get("containers") or []]},
            "status": {"phase": (pod.get("status") or {}).get("phase")}}


def _slim_container(container: dict[str, Any]) -> dict[str, Any]:
    return {"restartPolicy": container.get("restartPolicy"),
            "resources": container.get("resources") or {}}


class PodLister:
    """Non-terminal pods that request GPUs: all namespaces when the operator runs
    cluster-wide, else the namespaces of its jobs (what namespaced RBAC lets it read). One
    LIST serves every pass of the next `max_age_seconds`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_age_seconds: float = 10.0) -> None:
        self.clusterwide = True  # handlers.startup sets kopf's mode (-A or -n)
        self.max_age_seconds = max_age_seconds  # handlers.startup: CEPHALO_RECHECK_SECONDS
        self.clock = clock
        self.num_lists = 0
        self._pods: list[dict[str, Any]] = []
        self._listed_at: float | None = None
        self._listed_namespaces: frozenset[str] = frozenset()
        self._lock = asyncio.Lock()

    def _fresh(self, namespaces: frozenset[str]) -> bool:
        return (self._listed_at is not None
                and self.clock() - self._listed_at <= self.max_age_seconds
                and (self.clusterwide or namespaces <= self._listed_namespaces))

    async def pods(self, kube: AsyncKube, namespaces: Iterable[str], *,
                   fresh: bool = False) -> list[dict[str, Any]]:
        """The pods; `fresh`: from a LIST made now, whatever the age of the last one."""
        wanted = frozenset(namespaces)
        async with self._lock:
            if fresh or not self._fresh(wanted):
                started = self.clock()
                self._pods = await self._list(kube, wanted)
                self._listed_at, self._listed_namespaces = started, wanted
                self.num_lists += 1
            return list(self._pods)

    def invalidate(self) -> None:
        """The next pass lists again: after a gang release the re-plan must see the pods
        that took its GPUs, not a listing from before they were bound."""
        self._listed_at = None

    async def _list(self, kube: AsyncKube, namespaces: frozenset[str]) -> list[dict[str, Any]]:
        query = "?fieldSelector=" + quote(NOT_TERMINAL, safe="")
        if self.clusterwide:
            pods_path = core_path(None, "pods")
            return await kube.list(f"{pods_path}{query}", keep=_gpu_pod_slim)
        items: list[dict[str, Any]] = []
        for namespace in sorted(namespaces):
            pods_path = core_path(namespace, "pods")
            items += await kube.list(f"{pods_path}{query}", keep=_gpu_pod_slim)
        return items


def _gpu_pod_slim(pod: dict[str, Any]) -> dict[str, Any] | None:
    """What PodLister keeps of a listed pod: its slim form if it can hold GPUs, else nothing
    (applied page by page: most of a cluster's pods request no GPU)."""
    return slim_pod(pod) if holds_gpus(pod) and pod_gpu_request(pod) > 0 else None


# The operator's registries (one process, one event loop): fed by handlers and reconcile.
CLAIMS = GpuClaims()
PODS = PodLister()


async def free_pools(kube: AsyncKube, key: JobKey, uid: str, nodes: list[dict[str, Any]],
                     tolerations: list[dict[str, Any]], *, fresh: bool = False) -> Discovery:
    """Discovery on the GPUs free for job `key` now (`fresh`: from a pod LIST made now, not
    the shared one of the last recheck period). Everything after the LIST is one
    synchronous step: a caller that claims its choice before its next `await` cannot choose
    GPUs another pass chose meanwhile."""
    pods = await PODS.pods(kube, CLAIMS.namespaces | {key[0]}, fresh=fresh)
    usage = gpu_usage(pods, uid, CLAIMS.others(uid), nodes)
    return discover_pools(nodes, usage, tolerations)
