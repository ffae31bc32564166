"""The network probe (issue 35, items 1 and 4; docs/network.md): measure the links between a
job's GPUs on the cluster before planning it, and cache what was measured.

Which probes (`probes_needed`, pure): for a job that may use two GPUs or more, one
**inter-node** probe per pair of neighbouring pools (sorted by name: A-B, B-C, ...; one pool
alone on two nodes or more: A-A on two of its nodes) and one **intra-node** probe per pool
whose nodes hold two free GPUs or more. What the job pins by hand (spec.planner.network
interNodeGbps / intraNodeGbps, or the flat networkBandwidthGbps) is not probed. Each probe is
a gang of the job's trainer image (netprobe_render.py): two pods on two nodes, or one pod
with two GPUs, running `python -m cephalo.trainer.netprobe` (seconds: the large transfer
shrinks on a slow link); rank 0's termination message is the fitted CollectiveProfile.

Polite and bounded: probes run one at a time (they would share NICs and GPUs), after the
job's GPU profiles; each is a gang like the job's ranks (Kueue, Volcano, coscheduling); the
ranks give up joining after a minute, and a probe not done within
CEPHALO_NETWORK_PROBE_TIMEOUT_SECONDS of its creation (pending, or a node that cannot reach
the other) is given up: the job plans without it, condition NetworkMeasured False, a Warning
Event. A probe is never retried for the same job (the job's annotation records it).

Cached: a ConfigMap `cephalo-network-<kind>-<digest>` per probe in the job's namespace (not
owned by the job), with what was measured, on which nodes, when and for which job; reused by
every later job on the same pools until CEPHALO_NETWORK_PROFILE_MAX_AGE_SECONDS old.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.network_profile import INTER, INTRA, NETWORK_PROFILE_KEY, NetworkProfile
from cephalo.api.profile import CollectiveProfile
from cephalo.operator.discovery import Pool
from cephalo.operator.gang import pod_group_api, pod_groups_path, render_pod_group
from cephalo.operator.kube import core_path, job_path
from cephalo.operator.netprobe_render import netprobe_service_name, render_netprobe
from cephalo.operator.profiling import ANNOTATION_STARTED, ensure_spec_config_map
from cephalo.operator.render import LABEL_JOB, LABEL_ROLE, owner_reference
from cephalo.operator.status import JobPhase, PodPhase, pod_state, tail

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")
NETWORK_MEASURED = "NetworkMeasured"  # condition type
ANNOTATION_PROBES_FAILED = "cephalo.dev/network-probes-failed"  # probe key -> why, JSON
LABEL_NETWORK_PROFILE = "cephalo.dev/network-profile"
JOIN_TIMEOUT_SECONDS = 60.0  # the ranks' rendezvous (a node that cannot reach the other)


@dataclass(frozen=True)
class Probe:
    kind: str  # INTER or INTRA
    pools: tuple[str, ...]  # product labels: two for inter-node (maybe equal), one intra

    @property
    def key(self) -> str:
        return f"{self.kind}:{'|'.join(self.pools)}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:10]

    @property
    def config_map_name(self) -> str:
        return f"cephalo-network-{self.kind.split('-')[0]}-{self.digest}"

    def describe(self) -> str:
        return f"{self.kind} {' <-> '.join(self.pools)}" if self.kind == INTER else \
            f"{self.kind} {self.pools[0]} x2"


def pinned(spec: CephaloJobSpec) -> tuple[bool, bool]:
    """(inter-node, intra-node) links the job gives by hand: not probed."""
    planner = spec.planner
    flat = planner.network_bandwidth_gbps is not None
    network = planner.network
    return (flat or (network is not None and network.inter_node_gbps is not None),
            flat or (network is not None and network.intra_node_gbps is not None))


def probes_needed(spec: CephaloJobSpec, cluster: ClusterSpec, pools: list[Pool]) -> list[Probe]:
    """The probes that would describe the links a plan on `cluster` may cross."""
    if cluster.num_gpus < 2:
        return []  # one GPU: no collective crosses anything
    counts = {g.pool or g.product: g.count for g in cluster.groups}
    used = sorted((p for p in pools if counts.get(p.product, 0) > 0), key=lambda p: p.product)
    inter_pinned, intra_pinned = pinned(spec)
    probes: list[Probe] = []
    if not inter_pinned:
        names = [p.product for p in used]
        probes += [Probe(INTER, (a, b)) for a, b in itertools.pairwise(names)]
        if len(used) == 1 and len(_free_nodes(used[0])) >= 2:
            probes.append(Probe(INTER, (used[0].product, used[0].product)))
    if not intra_pinned:
        probes += [Probe(INTRA, (p.product,)) for p in used
                   if counts[p.product] >= 2 and max(_free_nodes(p), default=0) >= 2]
    return probes


def _free_nodes(pool: Pool) -> list[int]:
    """Free GPUs on each of the pool's nodes (all allocatable where not counted)."""
    return [g for g in pool.node_gpus if g > 0] if pool.node_gpus else [1] * len(pool.nodes)


async def cached(ctx: JobContext, probe: Probe, max_age_seconds: float | None = None
                 ) -> NetworkProfile | None:
    """The probe's cached measurement when it is there, readable and young enough."""
    cm = await ctx.kube.get(core_path(ctx.namespace, "configmaps", probe.config_map_name))
    try:
        profile = NetworkProfile.model_validate_json(
            (cm or {}).get("data", {}).get(NETWORK_PROFILE_KEY, ""))
    except ValidationError:
        return None
    limit = ctx.config.network_profile_max_age_seconds if max_age_seconds is None \
        else max_age_seconds
    return profile if profile.age_seconds(ctx.now) <= limit else None


async def cached_network(ctx: JobContext, cluster: ClusterSpec,
                         pools: list[Pool]) -> list[NetworkProfile]:
    """What is cached for the job's pools, of any age (a re-plan or rescale of a running job
    plans with the measurement it was first planned with; nothing is probed then)."""
    found = []
    for probe in probes_needed(ctx.job.spec, cluster, pools):
        profile = await cached(ctx, probe, max_age_seconds=float("inf"))
        if profile is not None:
            found.append(profile)
    return found


def _failed(ctx: JobContext) -> dict[str, str]:
    raw = (ctx.body["metadata"].get("annotations") or {}).get(ANNOTATION_PROBES_FAILED, "{}")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


async def measure(ctx: JobContext, cluster: ClusterSpec,
                  pools: list[Pool]) -> list[NetworkProfile] | None:
    """The measurements to plan with, or None while a probe runs (status says which).
    Probes that failed leave their links to labels or defaults (condition, Event)."""
    if not ctx.config.network_probe:
        return []
    probes = probes_needed(ctx.job.spec, cluster, pools)
    if not probes:
        return []
    failed = _failed(ctx)
    got: list[NetworkProfile] = []
    for probe in probes:
        profile = await cached(ctx, probe)
        if profile is not None:
            got.append(profile)
            continue
        if probe.key in failed:
            continue
        outcome = await _run(ctx, probe)
        if outcome is None:
            what = probe.describe()
            await ctx.write_status(JobPhase.PROFILING, f"measuring the network: {what}", {
                NETWORK_MEASURED: ("False", "Measuring", f"network probe running: {what}")})
            return None
        if isinstance(outcome, str):
            failed[probe.key] = outcome
            await ctx.kube.patch(job_path(ctx.namespace, ctx.name), {"metadata": {"annotations": {
                ANNOTATION_PROBES_FAILED: json.dumps(failed, sort_keys=True)}}})
            ctx.event("Warning", "NetworkProbeFailed",
                      f"{probe.describe()}: {outcome}; planned without it (set "
                      "spec.planner.network or label the nodes cephalo.dev/nic-gbps)")
            continue
        got.append(outcome)
    missing = [p.describe() for p in probes if p.key in failed]
    if missing:
        ctx.condition(NETWORK_MEASURED, "False", "ProbeFailed", "; ".join(
            f"{p.describe()}: {failed[p.key]}" for p in probes if p.key in failed)[:1000])
    else:
        ctx.condition(NETWORK_MEASURED, "True", "Measured", "; ".join(
            p.describe(ctx.now) for p in got)[:1000])
    return got


async def _run(ctx: JobContext, probe: Probe) -> NetworkProfile | str | None:
    """The probe's measurement once done, a failure (why), or None while it runs (its pods
    created here when there are none)."""
    objects = render_netprobe(ctx.job, probe.digest, list(probe.pools),
                              min(JOIN_TIMEOUT_SECONDS, ctx.config.network_probe_timeout_seconds),
                              ctx.config)
    service, pods_wanted = objects[0], objects[1:]
    pods_path = core_path(ctx.namespace, "pods")
    pods = [await ctx.kube.get(f"{pods_path}/{p['metadata']['name']}") for p in pods_wanted]
    if all(p is None for p in pods):
        await ensure_spec_config_map(ctx)  # mounted by every GPU pod of the job (its config)
        await ctx.kube.create(core_path(ctx.namespace, "services"), service)
        api = pod_group_api(ctx.job)
        if api is not None:
            group = render_pod_group(ctx.job, pods_wanted, group=f"{ctx.name}-np-{probe.digest}",
                                     owner=owner_reference(ctx.job))
            assert group is not None
            await ctx.kube.create(pod_groups_path(api, ctx.namespace), group)
        for pod in pods_wanted:
            pod["metadata"].setdefault("annotations", {})[ANNOTATION_STARTED] = f"{ctx.now:.3f}"
            await ctx.kube.create(pods_path, pod)
        log.info("%s/%s: network probe %s started", ctx.namespace, ctx.name, probe.describe())
        return None
    states = [None if p is None else pod_state(p) for p in pods]
    first = pods[0] or next(p for p in pods if p is not None)
    started = float((first["metadata"].get("annotations") or {}).get(ANNOTATION_STARTED, ctx.now))
    outcome: NetworkProfile | str | None = None
    if states[0] is not None and states[0].phase == PodPhase.SUCCEEDED:
        try:
            collectives = CollectiveProfile.model_validate_json(states[0].message or "")
        except ValidationError as err:
            outcome = (f"its rank 0 succeeded without a CollectiveProfile ({err.error_count()} "
                       f"errors): {tail(states[0].message, 200)}")
        else:
            measured = NetworkProfile.model_validate({
                "kind": probe.kind, "pools": list(probe.pools),
                "nodes": [(p or {}).get("spec", {}).get("nodeName") or "" for p in pods],
                "collectives": collectives, "measured_at": ctx.now,
                "measured_for": f"{ctx.namespace}/{ctx.name}"})
            await _store(ctx, probe, measured)
            ctx.event("Normal", "NetworkMeasured",
                      f"{measured.describe(ctx.now)} on {', '.join(measured.nodes)}; cached in "
                      f"ConfigMap {probe.config_map_name}")
            outcome = measured
    elif any(s is not None and s.phase == PodPhase.FAILED for s in states):
        bad = next(s for s in states if s is not None and s.phase == PodPhase.FAILED)
        outcome = f"a probe pod failed with exit code {bad.exit_code}: {tail(bad.message, 300)}"
    elif any(p is None for p in pods):
        outcome = "a probe pod vanished before the probe was done"
    elif ctx.now - started > ctx.config.network_probe_timeout_seconds:
        phases = ", ".join(str(s.phase) for s in states if s is not None)
        outcome = (f"not done within {ctx.config.network_probe_timeout_seconds:.0f} s (pods "
                   f"{phases}: no room for the gang, or a node that cannot reach the other)")
    if outcome is None:
        ctx.wake_in(min(ctx.config.recheck_seconds, 5.0))
        return None
    await delete_probes(ctx)
    return outcome


async def _store(ctx: JobContext, probe: Probe, profile: NetworkProfile) -> None:
    cm: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": probe.config_map_name, "namespace": ctx.namespace,
                     "labels": {LABEL_NETWORK_PROFILE: "true", LABEL_ROLE: "network-profile"}},
        "data": {NETWORK_PROFILE_KEY: profile.model_dump_json(), "probe": probe.key,
                 "measuredFor": profile.measured_for, "measuredAt": str(int(profile.measured_at)),
                 "summary": profile.describe(profile.measured_at)}}
    path = core_path(ctx.namespace, "configmaps")
    _existing, created = await ctx.kube.create(path, cm)
    if not created:  # an older measurement: replaced
        await ctx.kube.patch(f"{path}/{probe.config_map_name}", {"data": cm["data"]})


async def delete_probes(ctx: JobContext) -> None:
    """The job's probe pods, Service and PodGroups (done, given up, or the job ends)."""
    selector = f"{LABEL_JOB}={ctx.name},{LABEL_ROLE}=netprobe"
    for pod in await ctx.kube.list(core_path(ctx.namespace, "pods"), selector):
        await ctx.kube.delete(core_path(ctx.namespace, "pods", pod["metadata"]["name"]))
    await ctx.kube.delete(core_path(ctx.namespace, "services", netprobe_service_name(ctx.job)))
    api = pod_group_api(ctx.job)
    if api is not None:
        for group in await ctx.kube.list(pod_groups_path(api, ctx.namespace),
                                         f"{LABEL_JOB}={ctx.name}"):
            if group["metadata"]["name"].startswith(f"{ctx.name}-np-"):
                await ctx.kube.delete(f"{pod_groups_path(api, ctx.namespace)}/"
                                      f"{group['metadata']['name']}")


__all__ = ["NETWORK_MEASURED", "Probe", "cached_network", "delete_probes", "measure",
           "probes_needed"]
