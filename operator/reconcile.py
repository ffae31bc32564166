"""One level-triggered reconcile pass of a CephaloJob: read the world, take one step, report.

Every pass starts from a fresh GET of the job (never a cached body: the status it wrote a
moment ago must be the status it reads), so a pass is safe to repeat and an operator restart
resumes where the cluster says the job is. Children have deterministic names and are
created if absent; rank pods carry the attempt number and the hash of what they run, so
stale ones (older attempt, changed spec or plan) are recognised and replaced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from cephalo.api import CephaloJob, JobFileError, Plan, parse_job
from cephalo.api.plan import PlanError, parse_plan
from cephalo.operator import metrics
from cephalo.operator.config import OperatorConfig
from cephalo.operator.discovery import (
    NoGpusError,
    discover_pools,
    plan_fits,
    select_cluster,
)
from cephalo.operator.kube import AsyncKube, core_path, job_path
from cephalo.operator.profiling import ProfilingFailed, delete_profilers, profile
from cephalo.operator.render import (
    ANNOTATION_CONFIG_HASH,
    check_job_name,
    config_hash,
    plan_config_map_name,
    render,
)
from cephalo.operator.status import (
    FAILED,
    GPUS_AVAILABLE,
    PLANNED,
    SUSPENDED,
    merge_conditions,
    now_iso,
    parse_time,
)
from cephalo.operator.training import train
from cephalo.planner import InfeasibleError, solve

log = logging.getLogger("cephalo.operator")
TERMINAL = ("Succeeded", "Failed")


@dataclass
class JobContext:
    kube: AsyncKube
    config: OperatorConfig
    body: dict[str, Any]
    job: CephaloJob
    now: float = field(default_factory=time.time)
    next_check_seconds: float | None = None

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def status(self) -> dict[str, Any]:
        return self.body.get("status") or {}

    def wake_in(self, seconds: float) -> None:
        self.next_check_seconds = min(self.next_check_seconds or seconds, seconds)

    async def write_status(self, phase: str, message: str,
                           conditions: dict[str, tuple[str, str, str]] | None = None,
                           **fields: Any) -> None:
        """Merge-patch status (skipped when nothing changes: no write, no watch event)."""
        old = self.status
        new: dict[str, Any] = {"phase": phase, "message": message,
                               "observedGeneration": self.body["metadata"].get("generation"),
                               **fields}
        if conditions:
            new["conditions"] = merge_conditions(old.get("conditions"), conditions,
                                                 now_iso(self.now))
        if all(old.get(k) == v for k, v in new.items()):
            return
        patch = {k: _replacing(old.get(k), v) for k, v in new.items()}
        patched = await self.kube.patch(job_path(self.namespace, self.name, "status"),
                                        {"status": patch})
        if patched is not None:
            self.body = patched
        if old.get("phase") != phase:
            log.info("%s/%s: %s -> %s (%s)", self.namespace, self.name, old.get("phase"), phase,
                     message)
        metrics.set_phase(self.namespace, self.name, phase)

    async def fail(self, reason: str, message: str) -> None:
        kopf.event(self.body, type="Warning", reason=reason, message=message)
        await self.write_status("Failed", message, {FAILED: ("True", reason, message)},
                                completionTime=now_iso(self.now))


def _replacing(old: Any, new: Any) -> Any:
    """A merge patch that replaces `old` by `new` (keys that disappear are nulled)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch = {k: _replacing(old.get(k), v) for k, v in new.items()}
    patch.update({k: None for k in old if k not in new})
    return patch


async def reconcile(kube: AsyncKube, config: OperatorConfig, namespace: str,
                    name: str) -> float | None:
    """One pass; returns seconds until the next pass is due (None: only on events)."""
    body = await kube.get(job_path(namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        metrics.set_phase(namespace, name, None)
        return None
    try:
        check_job_name(name)
        job = parse_job({k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")},
                        source=f"CephaloJob {namespace}/{name}")
    except (JobFileError, ValueError) as err:
        ctx = JobContext(kube, config, body, CephaloJob.model_construct())
        if ctx.status.get("phase") != "Failed":
            await ctx.fail("InvalidSpec", str(err))
        return None
    ctx = JobContext(kube, config, body, job)
    metrics.set_phase(namespace, name, ctx.status.get("phase") or "Pending")
    if ctx.status.get("phase") in TERMINAL:
        return await _after_finish(ctx)
    if job.spec.suspend:
        await _suspend(ctx)
        return None
    try:
        await _step(ctx)
    except ProfilingFailed as err:
        await ctx.fail("ProfilingFailed", str(err))
    if ctx.status.get("phase") in TERMINAL:  # just finished: schedule the TTL, if any
        return await _after_finish(ctx)
    return ctx.next_check_seconds


async def _step(ctx: JobContext) -> None:
    nodes = await ctx.kube.list(core_path(None, "nodes"))
    discovery = discover_pools(nodes)
    plan_cm = await ctx.kube.get(core_path(ctx.namespace, "configmaps",
                                           plan_config_map_name(ctx.job)))
    plan = _read_plan(plan_cm)
    if plan is not None:
        assert plan_cm is not None
        stale = []
        if plan_cm["metadata"].get("annotations", {}).get(ANNOTATION_CONFIG_HASH) != config_hash(
                ctx.job, plan):
            stale.append("the spec changed")
        pools_used: dict[str, int] = {}
        for r in plan.ranks:
            pools_used[r.pool or r.gpu] = pools_used.get(r.pool or r.gpu, 0) + 1
        if lost := plan_fits(pools_used, discovery):
            stale.append("GPUs were lost (" + "; ".join(lost) + ")")
        if stale:
            message = "re-planning: " + " and ".join(stale)
            kopf.event(ctx.body, type="Warning" if lost else "Normal", reason="Replanning",
                       message=message + "; ranks restart from the last checkpoint")
            metrics.REPLANS.labels(ctx.namespace, ctx.name).inc()
            await ctx.kube.delete(core_path(ctx.namespace, "configmaps",
                                            plan_cm["metadata"]["name"]))
            await ctx.write_status("Planning", message, {PLANNED: ("False", "Replanning", message)})
            plan = None
    if plan is None:
        plan = await _plan(ctx, discovery, nodes)
        if plan is None:
            return
    await train(ctx, plan)


def _read_plan(cm: dict[str, Any] | None) -> Plan | None:
    if cm is None:
        return None
    try:
        return parse_plan(json.loads((cm.get("data") or {}).get("plan.json", "")))
    except (PlanError, ValueError):
        return None  # unreadable plan: plan again and overwrite it


async def _plan(ctx: JobContext, discovery: Any, nodes: list[dict[str, Any]]) -> Plan | None:
    try:
        cluster, pools = select_cluster(ctx.job.spec, discovery, nodes)
    except NoGpusError as err:
        await _no_gpus(ctx, str(err))
        return None
    found = ", ".join(f"{g.pool} x{g.count}" for g in cluster.groups)
    profiles = await profile(ctx, pools)
    if profiles is None:
        ctx.wake_in(ctx.config.recheck_seconds)
        return None
    await ctx.write_status("Planning", f"planning on {found}", {
        GPUS_AVAILABLE: ("True", "GpusFound", found),
        "Profiled": ("True", "Profiled", f"profiles for {', '.join(sorted(profiles))}")})
    started = time.perf_counter()
    try:
        # The solver is CPU-bound (seconds for big clusters): never on kopf's event loop.
        plan = await asyncio.to_thread(solve, ctx.job.spec, cluster, profiles)
    except InfeasibleError as err:
        await ctx.fail("Infeasible", str(err))
        return None
    finally:
        metrics.PLANNING_SECONDS.observe(time.perf_counter() - started)
    await delete_profilers(ctx)
    objects = render(ctx.job, plan, ctx.config)
    cm_path = core_path(ctx.namespace, "configmaps")
    _cm, created = await ctx.kube.create(cm_path, objects[0])
    if not created:  # a stale plan from before a restart: overwrite it
        await ctx.kube.patch(f"{cm_path}/{objects[0]['metadata']['name']}", {
            "metadata": {"annotations": objects[0]["metadata"]["annotations"]},
            "data": objects[0]["data"]})
    summary = _summary(ctx, plan)
    metrics.PREDICTED_SAMPLES.labels(ctx.namespace, ctx.name).set(
        plan.predicted_samples_per_second or 0.0)
    ratio = summary.get("speedupOverEvenFSDP")
    baseline = plan.baselines.get("even_fsdp")
    even = (f"{ratio:.2f}x even FSDP" if ratio else "even FSDP: "
            + ((baseline.reason or "infeasible") if baseline else "not evaluated"))
    pools = ", ".join(f"{k} x{v}" for k, v in summary["pools"].items())
    predicted = plan.predicted_samples_per_second or 0.0
    message = f"{plan.world_size} GPUs ({pools}), predicted {predicted:.1f} samples/s, {even}"
    kopf.event(ctx.body, type="Normal", reason="Planned", message=message)
    await ctx.write_status("Pending", "plan ready; starting ranks",
                           {PLANNED: ("True", "Planned", message)}, plan=summary)
    return plan


def _summary(ctx: JobContext, plan: Plan) -> dict[str, Any]:
    pools: dict[str, int] = {}
    for r in plan.ranks:
        pools[r.pool or r.gpu] = pools.get(r.pool or r.gpu, 0) + 1
    summary: dict[str, Any] = {"worldSize": plan.world_size,
                               "predictedSamplesPerSecond": plan.predicted_samples_per_second,
                               "configMap": plan_config_map_name(ctx.job),
                               "pools": dict(sorted(pools.items()))}
    even = plan.baselines.get("even_fsdp")
    if even and even.predicted_samples_per_second and plan.predicted_samples_per_second:
        summary["speedupOverEvenFSDP"] = round(
            plan.predicted_samples_per_second / even.predicted_samples_per_second, 4)
    return summary


async def _no_gpus(ctx: JobContext, message: str) -> None:
    since = parse_time(ctx.body["metadata"].get("creationTimestamp")) or ctx.now
    for c in ctx.status.get("conditions") or []:
        if c["type"] == GPUS_AVAILABLE and c["status"] == "False":
            since = parse_time(c.get("lastTransitionTime")) or since
    waited = ctx.now - since
    if waited > ctx.config.discovery_timeout_seconds:
        await ctx.fail("NoGpus", f"{message}; gave up after {waited:.0f} s")
        return
    await ctx.write_status("Pending", "waiting for GPUs: " + message,
                           {GPUS_AVAILABLE: ("False", "NoUsableGpus", message)})
    ctx.wake_in(ctx.config.recheck_seconds)


async def _suspend(ctx: JobContext) -> None:
    pods = await ctx.kube.list(core_path(ctx.namespace, "pods"),
                               f"cephalo.dev/job={ctx.name},cephalo.dev/role in (trainer,profiler)")
    for pod in pods:
        if not pod["metadata"].get("deletionTimestamp"):
            await ctx.kube.delete(core_path(ctx.namespace, "pods", pod["metadata"]["name"]))
    message = "suspended: all ranks stopped; resuming restarts them from the last checkpoint"
    await ctx.write_status("Suspended", message, {SUSPENDED: ("True", "Suspended", message)})


async def _after_finish(ctx: JobContext) -> float | None:
    ttl = ctx.job.spec.ttl_seconds_after_finished
    finished = parse_time(ctx.status.get("completionTime"))
    if ttl is None or finished is None:
        return None
    remaining = finished + ttl - ctx.now
    if remaining > 0:
        return remaining
    kopf.event(ctx.body, type="Normal", reason="Expired",
               message=f"deleting: finished {ttl} s ago (ttlSecondsAfterFinished)")
    await ctx.kube.delete(job_path(ctx.namespace, ctx.name))
    return None


__all__ = ["JobContext", "reconcile"]
