"""One level-triggered reconcile pass of a CephaloJob: read the world, take one step, report.

Every pass starts from a fresh GET of the job (never a cached body: the status it wrote a
moment ago must be the status it reads), so a pass is safe to repeat and an operator restart
resumes where the cluster says the job is. Children have deterministic names and are
created if absent, and count only when their controller ownerReference carries this job's
uid (an older job of the same name leaves children behind while the garbage collector
lags, or on purpose with `--cascade=orphan`: they are deleted, never adopted). Rank pods
carry the attempt number and the hash of what they run, so stale ones (older attempt,
changed spec or plan) are recognised and replaced. A pass writes status once, at its end
(`context.JobContext.flush`), and posts its Events only after that write succeeded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import kopf

from cephalo.api import CephaloJob, ClusterSpec, JobFileError, Plan, parse_job
from cephalo.api.network_profile import with_measured_network
from cephalo.api.plan import PlanError, parse_plan
from cephalo.operator import metrics, netprobe, netprobe_background, replan, rescale
from cephalo.operator.config import OperatorConfig
from cephalo.operator.context import JobContext, _replacing  # noqa: F401 (tests use it)
from cephalo.operator.discovery import (
    NoGpusError,
    Pool,
    discover_pools,
    job_tolerations,
    plan_fits,
    select_cluster,
)
from cephalo.operator.elastic import capped_spec
from cephalo.operator.gang_sync import delete_pod_groups, ensure_pod_group
from cephalo.operator.gpu_usage import CLAIMS, free_pools
from cephalo.operator.kube import AsyncKube, NotOwned, core_path, job_path, not_owned, owned_by
from cephalo.operator.netpol import ensure_network_policy
from cephalo.operator.nodes import NODES
from cephalo.operator.planning import PlanningFailed, plan_for
from cephalo.operator.podspec import pack_ranks, pods_fit, with_pod_ranks
from cephalo.operator.policy import REASON as POLICY_DENIED
from cephalo.operator.policy import refusal
from cephalo.operator.profiling import (
    ProfilingFailed,
    delete_profilers,
    measure_beyond,
    profile,
)
from cephalo.operator.render import (
    ANNOTATION_CONFIG_HASH,
    CHECKPOINTS_DURABLE,
    LABEL_JOB,
    LABEL_ROLE,
    CheckpointTarget,
    check_job_name,
    checkpoint_target,
    config_hash,
    plan_config_map_name,
    render,
)
from cephalo.operator.status import (
    FAILED,
    GPUS_AVAILABLE,
    PLANNED,
    RUNNING,
    SUSPENDED,
    TERMINAL_PHASES,
    JobPhase,
    now_iso,
    parse_time,
)
from cephalo.operator.training import stop_unfinished, train
from cephalo.planner.cost.topology import ASSUMED
from cephalo.planner.feedback.measured_sizes import (
    unmeasured_micro_batch_sizes,
    with_unmeasured_note,
)
from cephalo.planner.outputs.report import ASSUMED_NETWORK_HINT, plural

log = logging.getLogger("cephalo.operator")


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
        if ctx.status.get("phase") != JobPhase.FAILED or _edited_since_status(body):
            await ctx.fail("InvalidSpec", str(err))  # a new spec, a new message
            await ctx.flush()
        return None
    ctx = JobContext(kube, config, body, job)
    metrics.set_phase(namespace, name, ctx.status.get("phase") or JobPhase.PENDING)
    if _spec_fixed(ctx):
        # Failed for its spec alone (nothing ran) and edited since: try the new spec.
        message = "the spec changed after it was refused; starting again"
        await ctx.write_status(JobPhase.PENDING, message,
                               {FAILED: ("False", "SpecChanged", message)}, completionTime=None)
        await ctx.flush()
    if ctx.status.get("phase") in TERMINAL_PHASES:
        return await _after_finish(ctx)
    if job.spec.suspend:
        await _suspend(ctx)
        return None
    # Issue 39 item 9, issue 46 item 7: what the job asks of its pods (volume types, service
    # account, images, priority classes, tolerations) against the chart's jobPolicy, before
    # any pod; again on every pass, so a job admitted before the policy (or without the
    # admission policy) never runs.
    refused = refusal(job.spec, config.job_policy())
    first_pass = ctx.status.get("startTime") is None  # _past_deadline writes it now
    try:
        if refused:
            await ctx.fail(POLICY_DENIED, refused)
        elif not await _past_deadline(ctx):
            await _step(ctx, first_pass)
    except ProfilingFailed as err:
        await ctx.fail("ProfilingFailed", str(err))
    except NotOwned as err:  # an older job's child holds a name: wait for it to go
        log.info("%s/%s: %s", namespace, name, err)
        ctx.wake_in(config.recheck_seconds)
    except Exception:
        # Keep what was decided before the failure (each decision follows the action it
        # records, e.g. the plan summary after the plan ConfigMap exists); then retry.
        with contextlib.suppress(Exception):
            await ctx.flush()
        raise
    await ctx.flush()
    if ctx.status.get("phase") in TERMINAL_PHASES:  # just finished: clean up, schedule TTL
        return await _after_finish(ctx)
    return ctx.next_check_seconds


# Failures that only say the spec cannot work (no pod ran): an edited spec gets a new try.
SPEC_FAILURE_REASONS = frozenset({"InvalidSpec", "Infeasible", "PlanningFailed",
                                  POLICY_DENIED})


def _edited_since_status(body: dict[str, Any]) -> bool:
    """The spec changed after the last status write (generation moves on spec edits only)."""
    status = body.get("status") or {}
    return body["metadata"].get("generation") != status.get("observedGeneration")


def _spec_fixed(ctx: JobContext) -> bool:
    if ctx.status.get("phase") != JobPhase.FAILED or not _edited_since_status(ctx.body):
        return False
    failed = [c for c in ctx.status.get("conditions") or [] if c.get("type") == FAILED]
    return bool(failed) and failed[0].get("reason") in SPEC_FAILURE_REASONS


async def _past_deadline(ctx: JobContext) -> bool:
    """Record the start (operator clock) and fail the job past spec.activeDeadlineSeconds.

    Measured from status.startTime, which this operator wrote from its own clock, against
    that same clock: no comparison with the API server's timestamps, whose clock may differ.
    """
    started = parse_time(ctx.status.get("startTime"))
    if started is None:
        phase = ctx.phase if ctx.phase not in (None, JobPhase.SUSPENDED) else JobPhase.PENDING
        await ctx.write_status(phase, ctx.status.get("message") or "starting",
                               startTime=now_iso(ctx.now))
        started = ctx.now
    deadline = ctx.job.spec.active_deadline_seconds
    if deadline is None:
        return False
    remaining = started + deadline - ctx.now
    if remaining > 0:
        ctx.wake_in(remaining)
        return False
    message = (f"active for {ctx.now - started:.0f} s, past activeDeadlineSeconds {deadline}; "
               "ranks stopped (their last checkpoint is kept)")
    await ctx.fail("DeadlineExceeded", message)
    await ctx.write_status(JobPhase.FAILED, message, {RUNNING: ("False", "DeadlineExceeded",
                                                                 message)})
    return True


async def _step(ctx: JobContext, first_pass: bool = False) -> None:
    # The node watch's shared view, not a LIST a pass; a LIST for the job's first plan.
    nodes = await NODES.nodes(ctx.kube, fresh=first_pass)
    # Every allocatable GPU the job's pods may use: what the re-plan check (GPUs lost) reads;
    # planning itself reads only the free ones (gpu_usage.free_pools).
    discovery = discover_pools(nodes, tolerations=job_tolerations(ctx.job.spec))
    cm_path = core_path(ctx.namespace, "configmaps")
    plan_cm = await ctx.kube.get(f"{cm_path}/{plan_config_map_name(ctx.job)}")
    if plan_cm is not None and not owned_by(plan_cm, ctx.uid):
        await ctx.kube.delete(f"{cm_path}/{plan_cm['metadata']['name']}",  # an older job's
                              plan_cm["metadata"]["uid"])
        raise not_owned(plan_cm)
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
        CLAIMS.claim((ctx.namespace, ctx.name), ctx.uid, pools_used)  # held until re-planned
        if lost := plan_fits(pools_used, discovery) or pods_fit(  # multi-GPU pods' nodes
                plan, {p.product: p.node_gpus for p in discovery.pools}):
            stale.append("GPUs were lost (" + "; ".join(lost) + ")")
        if stale:
            message = "re-planning: " + " and ".join(stale)
            ctx.event("Warning" if lost else "Normal", "Replanning",
                      message + "; ranks restart from the last checkpoint")
            ctx.after_write(lambda: _count(metrics.REPLANS, ctx))
            await ctx.kube.delete(f"{cm_path}/{plan_cm['metadata']['name']}",
                                  plan_cm["metadata"]["uid"])
            await ctx.write_status(JobPhase.PLANNING, message,
                                   {PLANNED: ("False", "Replanning", message)})
            plan = None
    if plan is None:
        plan = await _plan(ctx, nodes)
        if plan is None:
            return
    elif (back := await rescale.roll_back(ctx, nodes, plan)) is not None:
        # spec.elastic: the grown gang was not admitted in time (a gang scheduler's quota):
        # back to the GPUs the job had, from the checkpoint its drain wrote.
        plan = await _adopt(ctx, back.plan, back.pools, back.storage)
    elif (grown := await rescale.consider(ctx, nodes, plan)) is not None:
        # spec.elastic: more GPUs pay for a restart. The ranks of the old plan are stale
        # now; train() drains them (SIGTERM: a checkpoint at the next step boundary) and
        # starts the new plan's, which resume from that checkpoint.
        plan = await _adopt(ctx, grown.plan, grown.pools, grown.storage)
    elif (better := await replan.consider(ctx, nodes, plan)) is not None:
        # spec.planner.replan: the measured steps recalibrated the model, and its plan on
        # the same GPUs pays for a restart: adopted the same way as a rescale.
        plan = await _adopt(ctx, better.plan, better.pools, better.storage)
    await ensure_pod_group(ctx, plan)  # Volcano/coscheduling: the PodGroup before its pods
    await ensure_network_policy(ctx)  # opt-in: only the job's own ranks reach its ranks
    await train(ctx, plan)
    # A link the plan left unmeasured (a re-plan never waits on a probe): probed beside the
    # running gang on free GPUs; stopped whenever the gang is not running.
    await netprobe_background.probe_beside(ctx, nodes, plan)


async def _count(counter: Any, ctx: JobContext) -> None:
    counter.labels(ctx.namespace, ctx.name).inc()


def _read_plan(cm: dict[str, Any] | None) -> Plan | None:
    if cm is None:
        return None
    try:
        return parse_plan(json.loads((cm.get("data") or {}).get("plan.json", "")))
    except (PlanError, ValueError):
        return None  # unreadable plan: plan again and overwrite it


async def _select(ctx: JobContext, nodes: list[dict[str, Any]],
                  fresh: bool) -> tuple[ClusterSpec, list[Pool]] | None:
    """The GPUs to plan on, of those free now (None: none, the job waits). Nothing awaits
    after the pod LIST on the way to a returned choice, so the caller claims it before any
    other pass can choose (see gpu_usage)."""
    key = (ctx.namespace, ctx.name)
    discovery = await free_pools(ctx.kube, key, ctx.uid, nodes, job_tolerations(ctx.job.spec),
                                 fresh=fresh)
    try:
        return select_cluster(capped_spec(ctx.job.spec), discovery, nodes,
                              ctx.config.locality_label_keys())
    except NoGpusError as err:
        CLAIMS.release(key)
        await _no_gpus(ctx, str(err))
        return None


async def _plan(ctx: JobContext, nodes: list[dict[str, Any]]) -> Plan | None:
    key = (ctx.namespace, ctx.name)
    chosen = await _select(ctx, nodes, fresh=False)
    if chosen is None:
        return None
    choice = {g.pool or g.product: g.count for g in chosen[0].groups}
    if ctx.status.get("phase") == JobPhase.PLANNING or not CLAIMS.holds(key, ctx.uid, choice):
        # A new claim, or the pass that solves: from a pod LIST made now, not the shared one
        # of up to a recheck period ago (a foreign pod placed since would be planned on).
        chosen = await _select(ctx, nodes, fresh=True)
        if chosen is None:
            return None
    cluster, pools = chosen
    CLAIMS.claim(key, ctx.uid, {g.pool or g.product: g.count for g in cluster.groups})
    # Issue 13: refuse before profiling or any rank pod (a plan uses every selected GPU).
    storage = checkpoint_target(ctx.job, sum(g.count for g in cluster.groups))
    if storage.refusal:
        await ctx.fail("InvalidSpec", storage.refusal)
        return None
    found = ", ".join(f"{g.pool} x{g.count}" for g in cluster.groups)
    profiles = await profile(ctx, pools)
    if profiles is None:
        ctx.wake_in(ctx.config.recheck_seconds)
        return None
    # The links between the GPUs, measured on the cluster (cached), after the profiles: a
    # probe would share the GPUs with a profiler.
    measured = await netprobe.measure(ctx, cluster, pools, nodes)
    if measured is None:
        return None  # a probe runs: measure() woke the job to look again soon
    cluster = with_measured_network(cluster, measured)
    await ctx.write_status(JobPhase.PLANNING, f"planning on {found}", {
        GPUS_AVAILABLE: ("True", "GpusFound", found),
        "Profiled": ("True", "Profiled", f"profiles for {', '.join(sorted(profiles))}")})
    if ctx.status.get("phase") != JobPhase.PLANNING:  # say so first: solving takes time
        ctx.wake_in(0.0)
        return None
    started = time.perf_counter()
    try:
        # In a limited child process, off kopf's event loop: no spec can take the operator
        # down; a time-out, MemoryError or planner bug fails this job only.
        plan = await plan_for(ctx.config, ctx.job.spec, cluster, profiles)
    except PlanningFailed as err:
        await ctx.fail(err.reason, str(err))
        return None
    finally:
        metrics.PLANNING_SECONDS.observe(time.perf_counter() - started)
    # Sizes beyond the profiled ones are measured before the plan is used (a rank's memory
    # there is an extrapolation): a profiler pass, then this step plans again.
    if wanted := unmeasured_micro_batch_sizes(plan, profiles):
        if ctx.config.measure_extra_sizes and await measure_beyond(ctx, wanted, profiles):
            return None
        plan = with_unmeasured_note(plan, wanted, profiles)
    await delete_profilers(ctx)
    await netprobe.delete_probes(ctx)
    return await _adopt(ctx, plan, pools, storage)


async def _adopt(ctx: JobContext, plan: Plan, pools: list[Pool],
                 storage: CheckpointTarget) -> Plan:
    """Make `plan` the job's plan: its ConfigMap written (rank pods of another plan are
    stale from here), the summary, Event and conditions decided."""
    if ctx.job.spec.ranks_per_pod != 1:  # several GPUs of a node per pod (issue 12)
        plan = with_pod_ranks(plan, pack_ranks(
            plan, {p.product: p.node_gpus for p in pools}, ctx.job.spec.ranks_per_pod))
    objects = render(ctx.job, plan, ctx.config)
    cm_path = core_path(ctx.namespace, "configmaps")
    _cm, created = await ctx.kube.create(cm_path, objects[0])
    if not created and not owned_by(_cm, ctx.uid):
        await ctx.kube.delete(f"{cm_path}/{_cm['metadata']['name']}", _cm["metadata"]["uid"])
        raise not_owned(_cm)
    if not created:  # a stale plan from before a restart: overwrite it
        await ctx.kube.patch(f"{cm_path}/{objects[0]['metadata']['name']}", {
            "metadata": {"annotations": objects[0]["metadata"]["annotations"]},
            "data": objects[0]["data"]})
    summary = _summary(ctx, plan)
    metrics.PREDICTED_SAMPLES.labels(ctx.namespace, ctx.name).set(
        plan.predicted_samples_per_second or 0.0)
    metrics.set_replica_groups(ctx.namespace, ctx.name, plan.replica_groups, plan.world_size)
    ratio = summary.get("speedupOverEvenFSDP")
    baseline = plan.baselines.get("even_fsdp")
    even = (f"{ratio:.2f}x even FSDP" if ratio else "even FSDP: "
            + ((baseline.reason or "infeasible") if baseline else "not evaluated"))
    used = ", ".join(f"{k} x{v}" for k, v in summary["pools"].items())
    predicted = plan.predicted_samples_per_second or 0.0
    groups = f", hybrid: {summary['replicaGroups']} replica groups of " \
        f"{summary['replicaGroupSize']}" if plan.replica_groups else ""
    message = f"{plural(plan.world_size, 'GPU')} ({used}){groups}, predicted " \
        f"{predicted:.1f} samples/s, {even}"
    ctx.event("Normal", "Planned", message)
    if plan.world_size > 1 and summary.get("networkSource") == ASSUMED:
        ctx.event("Warning", "NetworkAssumed", (
            f"the plan prices its collectives over an assumed network "
            f"({summary.get('networkGbps', 0):.3g} Gbit/s per GPU), not a measured one: "
            f"{ASSUMED_NETWORK_HINT}; or let the operator measure it (the chart's "
            "operator.networkProbe, on by default; condition NetworkMeasured says why it "
            "did not)"))
    if not storage.durable:
        ctx.event("Warning", "CheckpointsNotDurable", storage.message)
    await ctx.write_status(JobPhase.PENDING, "plan ready; starting ranks", {
        PLANNED: ("True", "Planned", message),
        CHECKPOINTS_DURABLE: (str(storage.durable), storage.reason, storage.message)},
        plan=summary)
    return plan


def _summary(ctx: JobContext, plan: Plan) -> dict[str, Any]:
    """status.plan (PlanSummary, wire names) of the plan the ranks run."""
    pools: dict[str, int] = {}
    for r in plan.ranks:
        pools[r.pool or r.gpu] = pools.get(r.pool or r.gpu, 0) + 1
    summary: dict[str, Any] = {"worldSize": plan.world_size,
                               "predictedSamplesPerSecond": plan.predicted_samples_per_second,
                               "configMap": plan_config_map_name(ctx.job),
                               "pools": dict(sorted(pools.items()))}
    source = plan.assumptions.get("network_source")
    bandwidth = plan.assumptions.get("network_bandwidth_bytes_per_second")
    if isinstance(source, str) and plan.world_size > 1:
        summary["networkSource"] = source[:256]
        if isinstance(bandwidth, int | float):
            summary["networkGbps"] = round(bandwidth * 8 / 1e9, 6)
    if plan.replica_groups:
        summary["replicaGroups"] = len(plan.replica_groups)
        summary["replicaGroupSize"] = len(plan.replica_groups[0])
        if plan.replicated_fraction:
            summary["replicatedFraction"] = plan.replicated_fraction
    even = plan.baselines.get("even_fsdp")
    if even and even.predicted_samples_per_second and plan.predicted_samples_per_second:
        summary["speedupOverEvenFSDP"] = round(
            plan.predicted_samples_per_second / even.predicted_samples_per_second, 4)
    return summary


async def _no_gpus(ctx: JobContext, message: str) -> None:
    # From the first pass that found no GPUs (the condition's transition, operator clock),
    # not from creationTimestamp: the API server's clock may disagree with ours.
    since = ctx.now
    for c in ctx.status.get("conditions") or []:
        if c["type"] == GPUS_AVAILABLE and c["status"] == "False":
            since = parse_time(c.get("lastTransitionTime")) or since
    waited = ctx.now - since
    if waited > ctx.config.discovery_timeout_seconds:
        await ctx.fail("NoGpus", f"{message}; gave up after {waited:.0f} s")
        return
    await ctx.write_status(JobPhase.PENDING, "waiting for GPUs: " + message,
                           {GPUS_AVAILABLE: ("False", "NoUsableGpus", message)})
    ctx.wake_in(ctx.config.recheck_seconds)


async def _suspend(ctx: JobContext) -> None:
    """Record Suspended first (the gang is no longer launched, the active time restarts on
    resume), then stop every rank and profiler pod."""
    message = "suspended: all ranks stopped; resuming restarts them from the last checkpoint"
    await ctx.write_status(JobPhase.SUSPENDED, message,
                           {SUSPENDED: ("True", "Suspended", message)},
                           launchedAttempt=None, startTime=None)
    await ctx.flush()
    pods = await ctx.kube.list(core_path(ctx.namespace, "pods"),
                               f"{LABEL_JOB}={ctx.name},{LABEL_ROLE} in (trainer,profiler)")
    for pod in pods:
        if not pod["metadata"].get("deletionTimestamp"):
            await ctx.kube.delete(core_path(ctx.namespace, "pods", pod["metadata"]["name"]),
                                  pod["metadata"]["uid"])
    # Kueue: the pods are gone, and their Workload with them. Volcano: a PodGroup left
    # Inqueue would keep its minResources reserved in the queue.
    await delete_pod_groups(ctx)


async def _after_finish(ctx: JobContext) -> float | None:
    if ctx.status.get("phase") == JobPhase.FAILED:  # idempotent: also after a crash
        await stop_unfinished(ctx)
        await delete_pod_groups(ctx)
    ttl = ctx.job.spec.ttl_seconds_after_finished
    finished = parse_time(ctx.status.get("completionTime"))
    if ttl is None or finished is None:
        return None
    remaining = finished + ttl - ctx.now
    if remaining > 0:
        return remaining
    kopf.event(ctx.body, type="Normal", reason="Expired",  # no status write: it goes
               message=f"deleting: finished {ttl} s ago (ttlSecondsAfterFinished)")
    await ctx.kube.delete(job_path(ctx.namespace, ctx.name))
    return None


__all__ = ["JobContext", "reconcile"]
