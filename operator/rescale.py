"""Elastic scaling, the I/O half (spec.elastic, issue 28): offer a Running job the GPUs it
could use now, plan on them, decide (cephalo.operator.elastic) and record why.

A pass of an elastic Running job with progress looks at what it could use: its own GPUs
plus the free ones (gpu_usage.free_pools: other jobs' pods and reservations subtracted),
as its pools, spec.maxGpus and elastic.maxGpus allow. When some pool offers more than the
plan uses and that offer was not decided on already, the job *claims* the whole offer
(CLAIMS, before its first await: two elastic jobs, or an elastic job and a job waiting for
GPUs, never both plan on the same free GPUs; the first pass to look wins, and jobs are woken
oldest first), plans on it with the cached profiles and decides. A pool without a cached
profile (its GPUs were busy when the job planned) is profiled first, on one of its GPUs
while the job trains on (elastic_profiling.py); the decision waits for it. A rescale keeps
the claim and returns the new plan, which reconcile adopts: the old ranks are stale,
train() drains them through SIGTERM (a checkpoint at the next step boundary, exit 143; no
restart, failure or preemption counted) and starts the new plan's ranks, which resume from
that checkpoint under the new sharding. A skip gives the claim back.

Status (`status.elastic`): the last decision with its figures, rescales, the last rescale's
time (the cooldown's start), and the restart cost as measured: from the drain (the rescale
decision) to the first step the new plan's rank 0 reports (`measure_restart`), which is what
the next decision weighs a saving against. An Event (Rescaled, RescaleSkipped) is posted
only when the verdict or its reason changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cephalo.api import ClusterSpec, GpuProfile, Plan
from cephalo.api.network_profile import with_measured_network
from cephalo.operator import metrics
from cephalo.operator.discovery import NoGpusError, Pool, job_tolerations, select_cluster
from cephalo.operator.elastic import (
    Decision,
    RescaleInputs,
    announce,
    capped_spec,
    decide,
    offers_more,
    record_restart,
    restart_cost,
    should_evaluate,
)
from cephalo.operator.elastic_profiling import FAILURES, profile_missing
from cephalo.operator.gang_timeout import unscheduled, unscheduled_reason
from cephalo.operator.gpu_usage import CLAIMS, free_pools
from cephalo.operator.kube import core_path
from cephalo.operator.netprobe import cached_network
from cephalo.operator.planning import PlanningFailed, plan_for
from cephalo.operator.profiling import cached_profiles
from cephalo.operator.render import LABEL_JOB, LABEL_ROLE, CheckpointTarget, checkpoint_target
from cephalo.operator.status import JobPhase, now_iso, parse_time

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")
NOT_ADMITTED = "NotAdmitted"
PROFILING = "Profiling"  # a pool freed since the job planned is profiled before deciding
# status.elastic fields of a rescale in progress, all cleared when it ends or rolls back
IN_PROGRESS = ("rescaleStartedTime", "rescaleFromStep", "rescaleFromGpus",
               "rescaleLaunchedTime")
MAX_RETRY_SECONDS = 86_400.0  # a rolled-back offer is looked at again at least daily


@dataclass(frozen=True)
class Growth:
    """A rescale decided: the new plan, the pools it was planned on, where checkpoints go."""

    plan: Plan
    pools: list[Pool]
    storage: CheckpointTarget


def plan_pools(plan: Plan) -> dict[str, int]:
    pools: dict[str, int] = {}
    for r in plan.ranks:
        pools[r.pool or r.gpu] = pools.get(r.pool or r.gpu, 0) + 1
    return pools


async def consider(ctx: JobContext, nodes: list[dict[str, Any]], plan: Plan) -> Growth | None:
    """A Growth when the job should rescale now; else None (with the decision recorded when
    one was made)."""
    spec, status = ctx.job.spec, ctx.status
    if spec.elastic is None or not spec.elastic.enabled or status.get("phase") != \
            JobPhase.RUNNING:
        return None
    elastic: dict[str, Any] = dict(status.get("elastic") or {})
    step = (status.get("progress") or {}).get("step")
    if elastic.get("rescaleStartedTime") or step is None:
        return None  # a rescale still on its way, or no step to count the rest from
    key = (ctx.namespace, ctx.name)
    current = plan_pools(plan)
    last = elastic.get("lastDecision") or {}

    async def offered(fresh: bool) -> tuple[dict[str, int], Any, list[Pool]] | None:
        """What the job could use now, if worth a decision (nothing awaits after the LIST)."""
        discovery = await free_pools(ctx.kube, key, ctx.uid, nodes, job_tolerations(spec),
                                     fresh=fresh)
        try:
            cluster, pools = select_cluster(capped_spec(spec), discovery, nodes,
                                        ctx.config.locality_label_keys())
        except NoGpusError:
            return None
        offer = {g.pool or g.product: g.count for g in cluster.groups}
        if not offers_more(current, offer) or not should_evaluate(
                offer, last.get("freeGpus"), last.get("verdict"),
                parse_time(last.get("retryTime")), ctx.now):
            return None
        return offer, cluster, pools

    # The shared pod LIST says whether anything is on offer; a claim is made only on a LIST
    # made now (a foreign pod placed since the shared one would be planned on).
    if await offered(fresh=False) is None or (found := await offered(fresh=True)) is None:
        return None
    offer, cluster, pools = found
    CLAIMS.claim(key, ctx.uid, offer)  # before any await: see the module docstring
    growth: Growth | None = None
    try:
        growth = await _decide(ctx, plan, offer, cluster, pools, int(step), elastic, nodes)
    finally:
        if growth is None:
            CLAIMS.claim(key, ctx.uid, current)  # declined (or failed): give the offer back
    return growth


async def _decide(ctx: JobContext, plan: Plan, offer: dict[str, int], cluster: Any,
                  pools: list[Pool], step: int, elastic: dict[str, Any],
                  nodes: list[dict[str, Any]]) -> Growth | None:
    spec = ctx.job.spec
    assert spec.elastic is not None
    figures: dict[str, Any] = {"freeGpus": dict(sorted(offer.items())),
                               "currentGpus": plan.world_size,
                               "currentSamplesPerSecond": plan.predicted_samples_per_second}
    storage = checkpoint_target(ctx.job, sum(offer.values()))
    if storage.refusal or not storage.durable:
        _record(ctx, elastic, Decision(
            "Skip", "NotDurable", f"{sum(offer.values())} GPUs are free, but a rescale "
            f"restarts from the last checkpoint and {storage.message}", 0.0, 0.0), figures)
        return None
    profiles, missing = await cached_profiles(ctx, pools)
    if missing:  # a pool freed since the job planned: profile it first (issue 39 item 1)
        before = dict(elastic)
        profiling = await profile_missing(ctx, missing, elastic)
        profiles.update(profiling.profiles)
        if profiling.waiting is not None:
            _record(ctx, elastic, Decision(
                "Skip", PROFILING, f"profiling {profiling.waiting.product} before deciding "
                "(no profile of it for this model yet; the job trains on meanwhile)", 0.0, 0.0,
                retry_at=ctx.now + ctx.config.recheck_seconds), figures, post_event=False)
            return None
        missing = profiling.left_out
        if elastic != before:
            ctx.record(elastic=elastic)  # a profiling failure recorded
    if missing:  # profiling failed there: plan on the profiled pools, look again later
        names = {p.product for p in missing}
        cluster = cluster.model_copy(update={"groups": [
            g for g in cluster.groups if (g.pool or g.product) not in names]})
        pools = [p for p in pools if p.product not in names]
        offer = {g.pool or g.product: g.count for g in cluster.groups}
        if not offers_more(plan_pools(plan), offer):
            retry = min(parse_time(((elastic.get(FAILURES) or {}).get(p.product) or {}).get(
                "retryTime")) or ctx.now for p in missing)
            _record(ctx, elastic, Decision(
                "Skip", "ProfilingFailed", f"profiling {', '.join(sorted(names))} failed "
                f"(status.elastic.{FAILURES}); it is tried again after a backoff", 0.0, 0.0,
                retry_at=max(retry, ctx.now + ctx.config.recheck_seconds)), figures)
            return None
        figures["freeGpus"] = dict(sorted(offer.items()))
    cluster = with_measured_network(cluster, await cached_network(ctx, cluster, pools, nodes))
    try:
        candidate = await plan_for(ctx.config, spec, cluster, profiles)
    except PlanningFailed as err:
        _record(ctx, elastic, Decision("Skip", "PlanningFailed",
                                       f"no plan on {_gpus(offer)}: {err}", 0.0, 0.0), figures)
        return None
    progress = ctx.status.get("progress") or {}
    cost, measured = restart_cost(elastic.get("restartSeconds"),
                                  spec.elastic.restart_cost_seconds)
    last_rescale = parse_time(elastic.get("lastRescaleTime"))
    decision = decide(RescaleInputs(
        now=ctx.now, current_gpus=plan.world_size, candidate_gpus=candidate.world_size,
        current_samples_per_second=plan.predicted_samples_per_second or 0.0,
        candidate_samples_per_second=candidate.predicted_samples_per_second or 0.0,
        measured_samples_per_second=progress.get("samplesPerSecond"),
        global_batch_size=spec.global_batch_size,
        remaining_steps=max(0, spec.training.steps - step), restart_cost_seconds=cost,
        restart_cost_measured=measured, min_gain=spec.elastic.min_gain,
        cooldown_seconds=spec.elastic.cooldown_seconds, last_rescale_at=last_rescale))
    figures.update(candidateGpus=candidate.world_size,
                   candidateSamplesPerSecond=candidate.predicted_samples_per_second,
                   measuredSamplesPerSecond=progress.get("samplesPerSecond"),
                   remainingSteps=max(0, spec.training.steps - step),
                   restartCostSeconds=round(cost, 3),
                   restartCostSource="measured" if measured else "default")
    _record(ctx, elastic, decision, figures)
    if decision.verdict != "Rescale":
        return None
    begin(ctx, plan, step)
    log.info("%s/%s: rescaling: %s", ctx.namespace, ctx.name, decision.reason)
    return Growth(candidate, pools, storage)


def begin(ctx: JobContext, plan: Plan, step: int) -> None:
    """A rescale of `plan` from `step` starts now (also a re-plan from measurements): counted
    in status.elastic and the rescale metric; measure_restart ends it."""
    elastic = dict(ctx.decided("elastic") or {})
    elastic.update(rescales=int(elastic.get("rescales") or 0) + 1,
                   lastRescaleTime=now_iso(ctx.now), rescaleStartedTime=now_iso(ctx.now),
                   rescaleFromStep=step, rescaleFromGpus=plan_pools(plan))
    ctx.record(elastic=elastic)
    ctx.after_write(lambda: _count(metrics.RESCALES, ctx))


def _gpus(offer: dict[str, int]) -> str:
    return ", ".join(f"{pool} x{n}" for pool, n in sorted(offer.items()))


def _record(ctx: JobContext, elastic: dict[str, Any], decision: Decision,
            figures: dict[str, Any], post_event: bool = True) -> None:
    """The decision into status.elastic.lastDecision; an Event when it says something new
    (unless the caller posts its own)."""
    last = elastic.get("lastDecision") or {}
    entry: dict[str, Any] = {
        "time": now_iso(ctx.now), "verdict": decision.verdict, "reasonCode": decision.code,
        "reason": decision.reason, **{k: v for k, v in figures.items() if v is not None},
        "gain": round(decision.gain, 4), "savedSeconds": round(decision.saved_seconds, 3)}
    if decision.retry_at is not None:
        entry["retryTime"] = now_iso(decision.retry_at)
    if post_event and announce((last.get("verdict"), last.get("reasonCode")), decision):
        if decision.verdict == "Rescale":
            ctx.event("Normal", "Rescaled", f"rescaling {decision.reason}; the ranks drain at "
                      "the next step boundary and resume from its checkpoint")
        else:
            ctx.event("Normal", "RescaleSkipped", f"not rescaling: {decision.reason}")
    if decision.verdict != "Rescale" and decision.code != PROFILING:  # counted once decided
        ctx.after_write(lambda: _count(metrics.RESCALE_SKIPS, ctx))
    ctx.record(elastic={**elastic, "lastDecision": entry})


def measure_restart(ctx: JobContext, progress: dict[str, Any]) -> None:
    """A rescale under way whose new plan's rank 0 reported a step past the drain: record
    the seconds from the drain to now as a measured restart cost, and end the rescale."""
    elastic: dict[str, Any] = dict(ctx.decided("elastic") or {})
    started = parse_time(elastic.get("rescaleStartedTime"))
    step = progress.get("step")
    if started is None or step is None or step <= int(elastic.get("rescaleFromStep") or 0):
        return
    seconds = max(0.0, ctx.now - started)
    elastic["restartSeconds"] = record_restart(elastic.get("restartSeconds"), seconds)
    for name in IN_PROGRESS:
        elastic.pop(name, None)
    ctx.record(elastic=elastic)
    log.info("%s/%s: rescale done: step %s after %.1f s", ctx.namespace, ctx.name, step,
             seconds)


def note_launch(ctx: JobContext) -> None:
    """Every rank pod of the current plan exists: a rescale's timeout runs from here."""
    elastic: dict[str, Any] = dict(ctx.decided("elastic") or {})
    if elastic.get("rescaleStartedTime") and not elastic.get("rescaleLaunchedTime"):
        elastic["rescaleLaunchedTime"] = now_iso(ctx.now)
        ctx.record(elastic=elastic)


async def roll_back(ctx: JobContext, nodes: list[dict[str, Any]], plan: Plan) -> Growth | None:
    """A rescale whose new rank pods are not all scheduled rescaleTimeoutSeconds after they
    were created (a gang scheduler's quota refused the grown gang: Kueue keeps it gated,
    Volcano keeps it pending) goes back to the GPUs the job had: a Growth on the previous
    plan's pools, which reconcile adopts like a rescale (the waiting pods are stale then).
    Else None. The grown offer is looked at again only after a backoff (cooldownSeconds,
    doubled with every rollback, at most a day): a quota raised later is found then."""
    spec = ctx.job.spec
    elastic: dict[str, Any] = dict(ctx.decided("elastic") or {})
    launched = parse_time(elastic.get("rescaleLaunchedTime"))
    if spec.elastic is None or launched is None or not elastic.get("rescaleStartedTime"):
        return None
    timeout = spec.elastic.rescale_timeout_seconds
    waited = ctx.now - launched
    if waited < timeout:
        ctx.wake_in(timeout - waited)
        return None
    pods = await ctx.kube.list(core_path(ctx.namespace, "pods"),
                               f"{LABEL_JOB}={ctx.name},{LABEL_ROLE}=trainer")
    waiting = sorted((p for p in pods if unscheduled(p)), key=lambda p: p["metadata"]["name"])
    if not waiting:
        return None  # on nodes (starting, pulling images): measure_restart ends the rescale
    previous: dict[str, int] = elastic.get("rescaleFromGpus") or {}
    back = await _plan_on(ctx, nodes, previous)
    if back is None:
        ctx.wake_in(ctx.config.recheck_seconds)
        return None
    rollbacks = int(elastic.get("rollbacks") or 0) + 1
    backoff = min(MAX_RETRY_SECONDS, max(spec.elastic.cooldown_seconds, timeout)
                  * 2 ** (rollbacks - 1))
    offer = (elastic.get("lastDecision") or {}).get("freeGpus") or plan_pools(plan)
    reason = (f"the {plan.world_size}-GPU gang was not scheduled {waited:.0f} s after its pods "
              f"were created (rescaleTimeoutSeconds {timeout}): {len(waiting)} pod(s), e.g. "
              f"{waiting[0]['metadata']['name']}: {unscheduled_reason(waiting[0])}; back to "
              f"{_gpus(previous)}; {_gpus(offer)} is looked at again in {backoff:.0f} s")
    for name in IN_PROGRESS:
        elastic.pop(name, None)
    elastic["rollbacks"] = rollbacks
    ctx.event("Warning", "RescaleRolledBack", reason)
    _record(ctx, elastic, Decision("Skip", NOT_ADMITTED, reason, 0.0, 0.0,
                                   retry_at=ctx.now + backoff),
            {"freeGpus": dict(sorted(offer.items())), "currentGpus": back[0].world_size,
             "candidateGpus": plan.world_size}, post_event=False)
    ctx.after_write(lambda: _count(metrics.RESCALE_ROLLBACKS, ctx))
    log.warning("%s/%s: rescale rolled back: %s", ctx.namespace, ctx.name, reason)
    return Growth(back[0], back[1], checkpoint_target(ctx.job, back[0].world_size))


@dataclass(frozen=True)
class Held:
    """The GPUs a job holds (at most `gpus` per pool of what it can use now) as planner
    inputs, with their cached profiles."""

    cluster: ClusterSpec
    pools: list[Pool]
    profiles: dict[str, GpuProfile]


async def held_inputs(ctx: JobContext, nodes: list[dict[str, Any]], gpus: dict[str, int],
                      why: str) -> Held | None:
    """`gpus` per pool as the job can use them now, with cached profiles; None (logged:
    "no `why` yet") when they are not there or not all profiled."""
    spec = ctx.job.spec
    discovery = await free_pools(ctx.kube, (ctx.namespace, ctx.name), ctx.uid, nodes,
                                 job_tolerations(spec), fresh=True)  # a new plan: see consider
    try:
        cluster, pools = select_cluster(capped_spec(spec), discovery, nodes,
                                        ctx.config.locality_label_keys())
    except NoGpusError as err:
        log.info("%s/%s: no %s yet: %s", ctx.namespace, ctx.name, why, err)
        return None
    # The links as measured when the job was first planned (cached; nothing probed now).
    cluster = with_measured_network(cluster, await cached_network(ctx, cluster, pools, nodes))
    groups = [g.model_copy(update={"count": min(g.count, gpus.get(g.pool or g.product, 0))})
              for g in cluster.groups]
    groups = [g for g in groups if g.count > 0]
    kept = {g.pool or g.product for g in groups}
    pools = [p for p in pools if p.product in kept]
    profiles, missing = await cached_profiles(ctx, pools)
    if not groups or missing:
        log.info("%s/%s: no %s yet: none of %s usable with a cached profile",
                 ctx.namespace, ctx.name, why, _gpus(gpus))
        return None
    return Held(cluster.model_copy(update={"groups": groups}), pools, profiles)


async def _plan_on(ctx: JobContext, nodes: list[dict[str, Any]],
                   gpus: dict[str, int]) -> tuple[Plan, list[Pool]] | None:
    """The job planned on at most `gpus` per pool of what it can use now, from cached
    profiles (the plan it had, when those GPUs are still there); None when that fails."""
    held = await held_inputs(ctx, nodes, gpus, "rollback")
    if held is None:
        return None
    try:
        plan = await plan_for(ctx.config, ctx.job.spec, held.cluster, held.profiles)
    except PlanningFailed as err:
        log.info("%s/%s: no rollback yet: %s", ctx.namespace, ctx.name, err)
        return None
    return plan, held.pools


def rescaling(ctx: JobContext) -> bool:
    """A rescale is draining the old ranks or starting the new ones."""
    return bool((ctx.decided("elastic") or {}).get("rescaleStartedTime"))


async def _count(counter: Any, ctx: JobContext) -> None:
    counter.labels(ctx.namespace, ctx.name).inc()


__all__ = ["Growth", "Held", "begin", "consider", "held_inputs", "measure_restart",
           "note_launch", "plan_pools", "rescaling", "roll_back"]
