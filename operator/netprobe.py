"""The network probe (issue 35, items 1 and 4; docs/network.md): measure the links between a
job's GPUs on the cluster before planning it, and cache what was measured.

Which probes (netprobe_choice.py, pure): for a job that may use two GPUs or more, one
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

Cached cluster-wide (issue 46 item 5): a ConfigMap `cephalo-network-<kind>-<digest>` per
probe in the operator's namespace (CEPHALO_OPERATOR_NAMESPACE, the chart's downward API;
readable by the operator alone), keyed by the pools and their NIC identity, with what was
measured, on which nodes, when and the uid of the job it ran for (no job name: a job's
namespace never learns another's); reused by every later job on the same pools, in any
namespace, until CEPHALO_NETWORK_PROFILE_MAX_AGE_SECONDS old. Only a pool whose NIC was never
measured is probed (a pool measured in any pair answers every pair it is in).

Never waited on in a re-plan (issue 46 item 8): a job planned before plans at once with what
the cache knows (any age), the rest assumed and said so; once its gang runs, a link never
measured is probed beside it on free GPUs (netprobe_background.py), and that measurement, or
one another job caches, enters its next re-plan (spec.planner.replan) through the usual gain
rule.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cephalo.api.cluster import ClusterSpec
from cephalo.api.network_profile import NETWORK_PROFILE_KEY, NetworkProfile
from cephalo.api.profile import CollectiveProfile
from cephalo.operator.discovery import Pool
from cephalo.operator.gang import pod_group_api, pod_groups_path, render_pod_group
from cephalo.operator.kube import ApiError, core_path, job_path
from cephalo.operator.netprobe_choice import (
    LABEL_NETWORK_PROFILE,
    Probe,
    answer,
    nic_identities,
    probes_needed,
    read_cache,
)
from cephalo.operator.netprobe_render import netprobe_service_name, render_netprobe
from cephalo.operator.profiling import ANNOTATION_STARTED, ensure_spec_config_map
from cephalo.operator.render import LABEL_JOB, LABEL_ROLE, owner_reference
from cephalo.operator.status import JobPhase, PodPhase, pod_state, tail

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")
NETWORK_MEASURED = "NetworkMeasured"  # condition type
NOT_MEASURED = "NotMeasured"  # its reason: a re-plan left a link unmeasured (not failed)
ANNOTATION_PROBES_FAILED = "cephalo.dev/network-probes-failed"  # probe key -> why, JSON
JOIN_TIMEOUT_SECONDS = 60.0  # the ranks' rendezvous (a node that cannot reach the other)
# Namespaces whose network cache the operator was refused a LIST of (logged once each).
_CACHE_REFUSED: set[str] = set()


def cache_namespace(ctx: JobContext) -> str:
    """Where measurements are cached: the operator's namespace (one cache for every job,
    readable by the operator alone); the job's own when the operator does not know its
    namespace (kopf run by hand)."""
    return ctx.config.operator_namespace or ctx.namespace


async def cached_all(ctx: JobContext) -> list[NetworkProfile]:
    """Every readable measurement in the cache (one LIST: a few per pair of pools); none
    when the operator may not list it (said once per namespace: the job plans with what
    it has, never fails on a cache)."""
    namespace = cache_namespace(ctx)
    try:
        listed = await ctx.kube.list(core_path(namespace, "configmaps"),
                                     f"{LABEL_NETWORK_PROFILE}=true")
    except ApiError as err:
        if err.status != HTTPStatus.FORBIDDEN:
            raise
        # An operator run without CEPHALO_OPERATOR_NAMESPACE under the chart's RBAC: the
        # ClusterRole gets ConfigMaps by name only; LIST is granted in its own namespace.
        if namespace not in _CACHE_REFUSED:
            _CACHE_REFUSED.add(namespace)
            log.warning("network cache in namespace %s not listable (%s): planning without "
                        "cached network measurements; set CEPHALO_OPERATOR_NAMESPACE to the "
                        "operator's namespace (the chart does) or grant list on configmaps "
                        "there", namespace, err)
        return []
    return read_cache(listed)


async def cached_network(ctx: JobContext, cluster: ClusterSpec, pools: list[Pool],
                         nodes: list[dict[str, Any]]) -> list[NetworkProfile]:
    """What the cache answers for the job's pools, of any age (a re-plan or rescale of a
    running job plans with what is known; nothing is probed then)."""
    needed = probes_needed(ctx.job.spec, cluster, pools, nic_identities(pools, nodes))
    if not needed:
        return []
    return answer(needed, await cached_all(ctx), now=ctx.now,
                  max_age_seconds=float("inf")).measured


def failed_probes(ctx: JobContext) -> dict[str, str]:
    raw = (ctx.body["metadata"].get("annotations") or {}).get(ANNOTATION_PROBES_FAILED, "{}")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


async def measure(ctx: JobContext, cluster: ClusterSpec, pools: list[Pool],
                  nodes: list[dict[str, Any]]) -> list[NetworkProfile] | None:
    """The measurements to plan with, or None while a probe runs (status says which).
    Probes that failed leave their links to labels or defaults (condition, Event).

    A job planned before (a re-plan: GPUs lost, the spec changed) never waits on a probe:
    it plans at once with what the cache knows, of any age, and says which links it assumed
    (issue 46 item 8: the probe's pods would wait for GPUs the job's own ranks hold)."""
    if not ctx.config.network_probe:
        return []
    probes = probes_needed(ctx.job.spec, cluster, pools, nic_identities(pools, nodes))
    if not probes:
        return []
    cached = await cached_all(ctx)
    if ctx.status.get("plan"):  # planned before: never wait
        known = answer(probes, cached, now=ctx.now, max_age_seconds=float("inf"))
        say_measured(ctx, known.measured, NOT_MEASURED, {
            p.describe(): "never measured (a re-plan does not wait on a probe: planned with "
            "the node labels or the assumed figure; probed beside the running gang on free "
            "GPUs)" for p in known.to_probe})
        return known.measured
    failed = failed_probes(ctx)
    while True:
        known = answer(probes, cached, now=ctx.now,
                       max_age_seconds=ctx.config.network_profile_max_age_seconds)
        probe = next((p for p in known.to_probe if p.key not in failed), None)
        if probe is None:
            break
        outcome = await run_probe(ctx, probe)
        if outcome is None:
            what = probe.describe()
            await ctx.write_status(JobPhase.PROFILING, f"measuring the network: {what}", {
                NETWORK_MEASURED: ("False", "Measuring", f"network probe running: {what}")})
            return None
        if isinstance(outcome, str):
            await record_failure(ctx, failed, probe, outcome, "planned without it")
            continue
        cached.append(outcome)  # may answer the probes after it (a pool's NIC)
    say_measured(ctx, known.measured, "ProbeFailed",
                  {p.describe(): failed[p.key] for p in known.to_probe})
    return known.measured


async def record_failure(ctx: JobContext, failed: dict[str, str], probe: Probe, why: str,
                         what_now: str) -> None:
    """A probe that failed: in the job's annotation (never tried again for it) and an Event."""
    failed[probe.key] = why
    await ctx.kube.patch(job_path(ctx.namespace, ctx.name), {"metadata": {"annotations": {
        ANNOTATION_PROBES_FAILED: json.dumps(failed, sort_keys=True)}}})
    ctx.event("Warning", "NetworkProbeFailed",
              f"{probe.describe()}: {why}; {what_now} (set spec.planner.network or label the "
              "nodes cephalo.dev/nic-gbps)")


def say_measured(ctx: JobContext, measured: list[NetworkProfile], reason: str,
                  missing: dict[str, str]) -> None:
    """Condition NetworkMeasured: the figures planned with, or the links left unmeasured
    (`reason` says why)."""
    if missing:
        ctx.condition(NETWORK_MEASURED, "False", reason, "; ".join(
            f"{what}: {why}" for what, why in missing.items())[:1000])
    else:
        ctx.condition(NETWORK_MEASURED, "True", "Measured", "; ".join(
            p.describe(ctx.now) for p in measured)[:1000])


async def run_probe(ctx: JobContext, probe: Probe) -> NetworkProfile | str | None:
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
                "nics": list(probe.nics), "collectives": collectives, "measured_at": ctx.now,
                "measured_for": ctx.uid})  # no job name: the cache is every namespace's
            await _store(ctx, probe, measured)
            ctx.event("Normal", "NetworkMeasured",
                      f"{measured.describe(ctx.now)} on {', '.join(measured.nodes)}; cached in "
                      f"ConfigMap {cache_namespace(ctx)}/{probe.config_map_name}")
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
    namespace = cache_namespace(ctx)
    cm: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": probe.config_map_name, "namespace": namespace,
                     "labels": {LABEL_NETWORK_PROFILE: "true", LABEL_ROLE: "network-profile"}},
        "data": {NETWORK_PROFILE_KEY: profile.model_dump_json(), "probe": probe.key,
                 "measuredAt": str(int(profile.measured_at)),
                 "summary": profile.describe(profile.measured_at)}}
    path = core_path(namespace, "configmaps")
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


__all__ = ["NETWORK_MEASURED", "NOT_MEASURED", "Probe", "cache_namespace", "cached_all",
           "cached_network", "delete_probes", "failed_probes", "measure", "probes_needed",
           "record_failure", "run_probe", "say_measured"]
