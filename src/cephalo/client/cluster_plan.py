"""The plan the operator would choose for a job now, on the cluster's free GPUs.

Every decision is the operator's own code, fed with what the operator reads:

* nodes → pools: `cephalo.operator.discovery.discover_pools` / `select_cluster`, with the
  job's tolerations (`job_tolerations`), cordons, taints, Ready, allocatable;
* GPUs taken: `cephalo.operator.gpu_usage.gpu_usage` over the non-terminal pods that request
  GPUs (every namespace when RBAC lets us list them) and the reservations of other
  CephaloJobs, rebuilt from their statuses with `GpuClaims.observe` (what the operator's job
  watch does after a restart);
* profiles: the operator's cached ConfigMaps (`profile_config_map_name`) in the job's
  namespace; a product without one is estimated from the catalog and said so (the operator
  would profile it first, so its plan may then differ);
* network: the operator's cached network measurements (`operator.netprobe`), each named in a
  note, as is each the operator would measure first (its plan may then differ);
* planning: the planner worker's own request path (`planner.worker.run_request`, what the
  operator's planning child runs), then the operator's pod packing.

What it cannot see: reservations the operator holds only in memory for jobs still profiling
or planning (their profiler pods are counted; the GPUs they will choose are not).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError

from cephalo.api import CephaloJob, ClusterSpec, GpuProfile, Plan, parse_plan
from cephalo.api.network_profile import with_measured_network
from cephalo.client.connection import RESOURCE, Session
from cephalo.client.errors import Forbidden
from cephalo.operator.config import OperatorConfig
from cephalo.operator.discovery import (
    Discovery,
    NoGpusError,
    Pool,
    discover_pools,
    job_tolerations,
    select_cluster,
)
from cephalo.operator.gpu_usage import (
    NOT_TERMINAL,
    GpuClaims,
    _gpu_pod_slim,
    gpu_usage,
    pod_gpu_request,
)
from cephalo.operator.kube import controller_uid, core_path, job_path
from cephalo.operator.netprobe_choice import (
    LABEL_NETWORK_PROFILE,
    answer,
    nic_identities,
    probes_needed,
    read_cache,
)
from cephalo.operator.podspec import pack_ranks, with_pod_ranks
from cephalo.operator.render import (
    LABEL_JOB,
    PROFILE_KEY,
    checkpoint_target,
    profile_config_map_name,
)
from cephalo.planner.feedback.measured_sizes import (
    describe_unmeasured,
    plan_on_measured_sizes,
    size_list,
)
from cephalo.planner.worker import encode_request, run_request

MEMORY_BYTES = 512 * 1024**2  # only named in the worker's out-of-memory message

# Where the operator caches its network measurements: its namespace, as the docs install it
# (`helm install ... -n cephalo-system`) unless this variable names another.
OPERATOR_NAMESPACE_ENV = "CEPHALO_OPERATOR_NAMESPACE"
DEFAULT_OPERATOR_NAMESPACE = "cephalo-system"


@dataclass(frozen=True)
class TakenGpus:
    """GPUs this job cannot have: on a node (a bound pod) or in a pool (planned, unbound)."""

    where: str  # node name, or "pool <product label>"
    gpus: int
    by: str  # "pod team-a/x", "CephaloJob team-b/y (planned, not on a node yet)"


@dataclass
class ClusterPlan:
    """What `plan_on_cluster` found; `plan` is None when the operator would not plan now
    (`error` says why: no free GPUs, an infeasible job, a refused checkpoint set-up)."""

    plan: Plan | None
    error: str | None
    error_reason: str | None
    cluster: ClusterSpec | None
    discovery: Discovery
    taken: list[TakenGpus]
    profiles: dict[str, str]  # catalog name → "cached ConfigMap <name>" | "catalog estimate"
    notes: list[str] = field(default_factory=list)


def plan_on_cluster(session: Session, job: CephaloJob, namespace: str,
                    trainer_image: str | None = None) -> ClusterPlan:
    spec = job.spec
    name = str(job.metadata.name)
    notes: list[str] = []
    nodes = session.call("list", "nodes", None, session.kube.list, core_path(None, "nodes"))
    jobs = _jobs(session, namespace, notes)
    this = next((j for j in jobs if j["metadata"].get("namespace") == namespace
                 and j["metadata"].get("name") == name), None)
    uid = str(this["metadata"].get("uid")) if this else ""
    if this:
        notes.append(f"CephaloJob {namespace}/{name} exists: planned as that job (its own pods "
                     "and reservation count as free)")
    claims = GpuClaims()
    for other in jobs:
        meta = other["metadata"]
        claims.observe((meta.get("namespace"), meta.get("name")), meta.get("uid"),
                       other.get("status") or {})
    pods = _pods(session, claims.namespaces | {namespace}, notes)
    others = claims.others(uid)
    usage = gpu_usage(pods, uid, others, nodes)
    discovery = discover_pools(nodes, usage, job_tolerations(spec))
    taken = _taken(pods, uid, others, nodes, jobs)
    for other in jobs:
        phase = (other.get("status") or {}).get("phase")
        if other is not this and phase in ("Profiling", "Planning"):
            meta = other["metadata"]
            notes.append(f"CephaloJob {meta['namespace']}/{meta['name']} is {phase.lower()}: "
                         "the GPUs it will choose are not reserved yet")
    result = ClusterPlan(None, None, None, None, discovery, taken, {}, notes)
    try:
        cluster, pools = select_cluster(spec, discovery, nodes)
    except NoGpusError as err:
        result.error, result.error_reason = str(err), "NoGpus"
        return result
    result.cluster = cluster
    storage = checkpoint_target(job, sum(g.count for g in cluster.groups))
    if storage.refusal:
        result.error, result.error_reason = storage.refusal, "InvalidSpec"
        return result
    config = OperatorConfig(trainer_image=trainer_image) if trainer_image else OperatorConfig()
    profiles = _cached_profiles(session, job, namespace, pools, config, result.profiles)
    cluster = _measured_network(session, job, cluster, pools, nodes, notes)
    result.cluster = cluster

    def solve(current: Mapping[str, GpuProfile]) -> Plan:
        outcome = run_request(encode_request(spec, cluster, dict(current)), MEMORY_BYTES)
        if outcome[0] != "ok":
            raise _PlanningError(str(outcome[1]), str(outcome[2]))
        return parse_plan(json.loads(outcome[1]))

    def cached_passes(wanted: Mapping[str, list[int]]) -> dict[str, GpuProfile] | None:
        return _cached_passes(session, job, namespace, config, wanted, result.profiles)

    # As the operator plans (reconcile._plan): sizes a plan assigns beyond the profiled
    # ones are measured by an extra profiler pass per product and planned again; here
    # each pass is read from the operator's cache.
    try:
        settled = plan_on_measured_sizes(solve, cached_passes, profiles)
    except _PlanningError as err:
        result.error, result.error_reason = err.message, err.reason
        return result
    plan = settled.plan
    if settled.not_measured:
        what = describe_unmeasured(settled.not_measured, settled.profiles)
        notes.append(f"the operator measures {what} before it uses the plan (one profiler "
                     "pass per GPU product, not cached yet): its plan may then differ")
    if spec.ranks_per_pod != 1:  # as the operator packs them (reconcile._plan)
        plan = with_pod_ranks(plan, pack_ranks(
            plan, {p.product: p.node_gpus for p in pools}, spec.ranks_per_pod))
    result.plan = plan
    return result


def _jobs(session: Session, namespace: str, notes: list[str]) -> list[dict[str, Any]]:
    """Every CephaloJob (their reservations); only this namespace's when RBAC says so."""
    try:
        return session.call("list", RESOURCE, None, session.kube.list,
                            "/apis/cephalo.dev/v1alpha1/cephalojobs")
    except Forbidden:
        notes.append("cannot list CephaloJobs in every namespace: only reservations of jobs "
                     f"in {namespace} are counted")
        return session.call("list", RESOURCE, namespace, session.kube.list,
                            job_path(namespace))


def _pods(session: Session, namespaces: set[str], notes: list[str]) -> list[dict[str, Any]]:
    """Non-terminal pods that request GPUs, slimmed as the operator keeps them: every
    namespace (what the operator sees cluster-wide), else the jobs' namespaces (namespaced
    RBAC, as the operator with -n)."""
    query = "?fieldSelector=" + quote(NOT_TERMINAL, safe="")
    try:
        return session.call("list", "pods", None, session.kube.list,
                            core_path(None, "pods") + query, None, _gpu_pod_slim)
    except Forbidden:
        notes.append("cannot list pods in every namespace: GPUs used by pods outside "
                     f"{', '.join(sorted(namespaces))} are not seen (the operator, cluster-wide, "
                     "sees them)")
    items: list[dict[str, Any]] = []
    for namespace in sorted(namespaces):
        items += session.call("list", "pods", namespace, session.kube.list,
                              core_path(namespace, "pods") + query, None, _gpu_pod_slim)
    return items


def _taken(pods: list[dict[str, Any]], uid: str, claims: list[Any],
           nodes: list[dict[str, Any]], jobs: list[dict[str, Any]]) -> list[TakenGpus]:
    """Who holds what gpu_usage subtracts: bound pods per node, and each other job's
    reservation per pool (gpu_usage over that job's pods and claim alone: reservations are
    computed per job, so these add up to the total it subtracts)."""
    names = {str(j["metadata"].get("uid")): f"{j['metadata']['namespace']}/{j['metadata']['name']}"
             for j in jobs}
    taken: list[TakenGpus] = []
    owners: set[str] = {c.uid for c in claims}
    for pod in pods:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        owner = controller_uid(pod)
        if owner == uid:
            continue
        cephalo = LABEL_JOB in (meta.get("labels") or {}) and owner is not None
        if cephalo:
            owners.add(str(owner))
        if spec.get("nodeName"):
            who = f"pod {meta.get('namespace')}/{meta.get('name')}"
            if cephalo:
                who += f" (CephaloJob {names.get(str(owner), meta['labels'][LABEL_JOB])})"
            taken.append(TakenGpus(spec["nodeName"], pod_gpu_request(pod), who))
    for owner in sorted(owners):
        own_pods = [p for p in pods if controller_uid(p) == owner]
        usage = gpu_usage(own_pods, uid, [c for c in claims if c.uid == owner], nodes)
        for pool, gpus in sorted(usage.reserved_by_pool.items()):
            taken.append(TakenGpus(f"pool {pool}", gpus, f"CephaloJob "
                                   f"{names.get(owner, owner)} (planned, not on a node yet)"))
    return sorted(taken, key=lambda t: (t.where, t.by))


def _measured_network(session: Session, job: CephaloJob, cluster: ClusterSpec,
                      pools: list[Pool], nodes: list[dict[str, Any]],
                      notes: list[str]) -> ClusterSpec:
    """The cluster with the operator's cached network measurements (any age: the operator
    would measure a stale one again first), each said in a note, as are the missing ones.
    They live in the operator's namespace ($CEPHALO_OPERATOR_NAMESPACE, else where the
    docs install it), readable by those who may read it there."""
    where = os.environ.get(OPERATOR_NAMESPACE_ENV) or DEFAULT_OPERATOR_NAMESPACE
    try:
        cms = session.call("list", "configmaps", where, session.kube.list,
                           core_path(where, "configmaps"), f"{LABEL_NETWORK_PROFILE}=true")
    except Forbidden:
        notes.append(f"network: the operator's measurements (namespace {where}) are not "
                     "readable with these credentials: planned without them (the operator "
                     "plans with them; set CEPHALO_OPERATOR_NAMESPACE if it runs elsewhere)")
        return cluster
    needed = probes_needed(job.spec, cluster, pools, nic_identities(pools, nodes))
    known = answer(needed, read_cache(cms), now=time.time(), max_age_seconds=float("inf"))
    notes += [f"network: {p.describe()} (cached by the operator)" for p in known.measured]
    notes += [f"network: {p.describe()} not measured yet (the operator's probe would measure "
              "it first, so its plan may differ)" for p in known.to_probe]
    return with_measured_network(cluster, known.measured)


class _PlanningError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def _cached_passes(session: Session, job: CephaloJob, namespace: str, config: OperatorConfig,
                   wanted: Mapping[str, list[int]],
                   said: dict[str, str]) -> dict[str, GpuProfile] | None:
    """The operator's cached extra passes for `wanted` ({product: sizes}), None when any
    is not cached (the operator would measure it first)."""
    found: dict[str, GpuProfile] = {}
    for product, sizes in wanted.items():
        name = profile_config_map_name(product, job, config, sizes)
        profile = _cached_profile(session, namespace, name)
        if profile is None:
            return None
        found[product] = profile
        said[product] += f" + ConfigMap {name} (sizes {size_list(sizes)})"
    return found


def _cached_profile(session: Session, namespace: str, name: str) -> GpuProfile | None:
    """The profile cached in ConfigMap `name`; None when there is none (or none readable)."""
    try:
        cm = session.call("get", "configmaps", namespace, session.kube.get,
                          core_path(namespace, "configmaps", name))
    except Forbidden:
        return None
    try:
        return GpuProfile.model_validate_json(((cm or {}).get("data") or {}).get(PROFILE_KEY, ""))
    except ValidationError:
        return None


def _cached_profiles(session: Session, job: CephaloJob, namespace: str, pools: list[Pool],
                     config: OperatorConfig, said: dict[str, str]) -> dict[str, GpuProfile]:
    profiles: dict[str, GpuProfile] = {}
    for pool in pools:
        assert pool.catalog_name is not None
        name = profile_config_map_name(pool.catalog_name, job, config)
        profile = _cached_profile(session, namespace, name)
        if profile is None:
            said[pool.catalog_name] = ("catalog estimate (no cached profile: the operator "
                                       "would profile it first)")
        else:
            profiles[pool.catalog_name] = profile
            said[pool.catalog_name] = f"cached ConfigMap {name}"
    return profiles
