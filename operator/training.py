"""Train and watch: rank pods up, phase from their states, gang restarts, progress.

What counts as what (docs/concepts/operator.md, "Restarts, disruptions and faults"):
* a rank pod of the current attempt not created yet (its POST failed, the operator stopped
  half-way) is created — until `status.launchedAttempt` records that every rank pod of this
  attempt and plan existed at once; only after that is a missing pod a *vanished* rank;
* a rank that failed, vanished, or was deleted by someone else (a terminating pod the
  operator did not delete) → gang restart counted in `status.restarts` (up to backoffLimit);
* a rank that was *disrupted* — a `DisruptionTarget` condition (preemption, eviction, drain,
  taint manager, kubelet shutdown) or an evicted/preempted pod — → gang restart from the
  checkpoint counted in `status.preemptions`, never toward backoffLimit.
The attempt number (`restarts + preemptions`) is on every rank pod, so a pod of an earlier
attempt or plan is recognised as stale and replaced.

Progress: the operator scrapes rank 0's `/metrics` (the Prometheus port every rank serves
anyway) over HTTP and copies step, loss and samples/s into status.progress. Trainer pods
need no Kubernetes credentials for this (their service-account token is not even mounted).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cephalo.api import Plan
from cephalo.api.plan import RankPlan
from cephalo.operator import disruptions, gang_timeout, metrics, rescale
from cephalo.operator.kube import core_path, not_owned, owned_by
from cephalo.operator.progress import final_progress
from cephalo.operator.progress import job_progress as _progress
from cephalo.operator.render import (
    ANNOTATION_CONFIG_HASH,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_ROLE,
    config_hash,
    rank_pod_names,
    render,
)
from cephalo.operator.status import (
    FAILED,
    POD_DONE,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    JobPhase,
    PodPhase,
    PodState,
    failure_summary,
    now_iso,
    pod_state,
)
from cephalo.planner.outputs.report import plural
from cephalo.rootcause import RankFailure, root_cause

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")


def attempt_of(status: dict[str, Any]) -> int:
    """Gang attempts so far: counted restarts plus disruptions (both restart every rank)."""
    return int(status.get("restarts") or 0) + int(status.get("preemptions") or 0)


async def train(ctx: JobContext, plan: Plan) -> None:
    job, status = ctx.job, ctx.status
    attempt = attempt_of(status)
    digest = config_hash(job, plan)
    launch = f"{attempt}/{digest}"
    launched = status.get("launchedAttempt") == launch
    objects = render(job, plan, ctx.config, attempt=attempt)
    pods_path = core_path(ctx.namespace, "pods")
    services_path = core_path(ctx.namespace, "services")
    service, _ = await ctx.kube.create(services_path, objects[1])
    if not owned_by(service, ctx.uid):
        await ctx.kube.delete(f"{services_path}/{service['metadata']['name']}",
                              service["metadata"]["uid"])
        raise not_owned(service)
    pods = await ctx.kube.list(pods_path, f"{LABEL_JOB}={ctx.name},{LABEL_ROLE}=trainer")
    wanted = {o["metadata"]["name"] for o in objects[2:]}
    # Another job's pods (an older job of the same name) are deleted, never adopted.
    stale = [p for p in pods if not owned_by(p, ctx.uid) or p["metadata"].get(
        "annotations", {}).get(ANNOTATION_CONFIG_HASH) != digest or p["metadata"]["labels"].get(
        LABEL_ATTEMPT) != str(attempt) or p["metadata"]["name"] not in wanted]
    if stale:
        for pod in stale:
            if not pod["metadata"].get("deletionTimestamp"):
                await ctx.kube.delete(f"{pods_path}/{pod['metadata']['name']}",
                                      pod["metadata"]["uid"])
        if rescale.rescaling(ctx):  # spec.elastic: draining for a new plan, no failure
            phase, why = JobPhase.RESTARTING, "rescaling: draining"
        else:
            phase = JobPhase.RESTARTING if attempt > 0 else JobPhase.PENDING
            why = "replacing"
        # The gang that launched is ending: should the next plan be that same plan again (a
        # node back before its pods are gone), its terminating pods are being let go, not
        # deleted by someone else.
        await ctx.write_status(phase, f"{why} {len(stale)} rank pod(s) of an earlier "
                               "attempt, plan or job", _resumed(status), launchedAttempt=None)
        ctx.wake_in(ctx.config.recheck_seconds)
        return
    by_name = {p["metadata"]["name"]: p for p in pods}
    pod_of = rank_pod_names(job, plan)  # a pod of several ranks stands for each of them
    present = [(r, pod_state(by_name[n])) for r in plan.ranks
               if (n := pod_of[r.rank]) in by_name]
    if await _lost_a_rank(ctx, plan, present, launched, (ctx.uid, str(attempt), digest)):
        return
    if not launched and any(s.deleting for _, s in present):
        # Not every rank ever ran together (a suspend just stopped them, or a pod was
        # removed before the gang was complete): let it go, then create it again.
        phase = (JobPhase.RESTARTING if status.get("phase") == JobPhase.RESTARTING
                 else JobPhase.PENDING)
        await ctx.write_status(phase, "waiting for terminating rank pods to go",
                               _resumed(status))
        ctx.wake_in(ctx.config.recheck_seconds)
        return
    for obj in objects[2:]:
        if obj["metadata"]["name"] not in by_name:  # not created yet in this attempt
            created, _ = await ctx.kube.create(pods_path, obj)
            if not owned_by(created, ctx.uid):
                await ctx.kube.delete(f"{pods_path}/{created['metadata']['name']}",
                                      created["metadata"]["uid"])
                raise not_owned(created)
            by_name[obj["metadata"]["name"]] = created
    if not launched:  # every rank pod of this attempt exists now: from here, missing = lost
        rescale.note_launch(ctx)  # a rescale's rescaleTimeoutSeconds runs from here
        await ctx.write_status(ctx.phase or JobPhase.PENDING, "rank pods created",
                               launchedAttempt=launch)
    if await gang_timeout.check(ctx, plan, by_name, created_now=not launched):
        return  # released: the ranks go, the job re-plans (scheduleTimeoutSeconds)
    states = [pod_state(by_name[pod_of[r.rank]]) for r in plan.ranks]
    await _report(ctx, plan, states)


async def _lost_a_rank(ctx: JobContext, plan: Plan, present: list[tuple[RankPlan, PodState]],
                       launched: bool, launch: disruptions.Launch) -> bool:
    """Restart (or fail) the gang when a rank was disrupted or failed, or — once every rank
    pod of the attempt existed — was deleted or vanished. True also while a missing pod's
    deletion event is awaited (nothing else is decided meanwhile)."""
    names = {s.name for _, s in present}
    pod_of = rank_pod_names(ctx.job, plan)
    # Gone between two looks: the pod watch says why, once it delivered the deletion.
    verdicts = {r.rank: disruptions.SEEN.missing(
        ctx.namespace, pod_of[r.rank], launch, ctx.now, ctx.config.pod_gone_grace_seconds)
        for r in plan.ranks if launched and pod_of[r.rank] not in names}
    missing = [r for r in plan.ranks if r.rank in verdicts]
    disrupted = [(r, s) for r, s in present if s.disruption] + [
        (r, PodState(name=pod_of[r.rank], phase="Failed", deleting=False, exit_code=None,
                     reason="PodDisappeared", message="the pod is gone, disrupted",
                     pod_ip=None, finished_at=None, disruption=why))
        for r in missing if (why := verdicts[r.rank].disruption)]
    if disrupted:
        await _restart(ctx, plan, *disrupted[0], disrupted=True)
        return True
    unseen = [pod_of[r.rank] for r in missing if verdicts[r.rank].waiting]
    if unseen:  # a failed peer may be its echo: decide nothing before the watch says why
        log.info("%s/%s: rank pod(s) %s gone; waiting for the deletion event that says why",
                 ctx.namespace, ctx.name, ", ".join(unseen))
        ctx.wake_in(min(ctx.config.recheck_seconds, ctx.config.pod_gone_grace_seconds))
        return True
    # A terminating pod of the current attempt was deleted by someone else: the operator
    # only deletes pods of an attempt it has already ended (they are stale by then).
    deleted = [(r, PodState(name=s.name, phase="Failed", deleting=True, exit_code=s.exit_code,
                            reason="PodDeleted", message="the pod was deleted while its gang "
                            "was running (not by the operator, not a disruption)",
                            pod_ip=None, finished_at=None))
               for r, s in present if s.deleting and launched]
    # Before the gang launched, a terminating pod is one being let go (suspend, a pending-
    # timeout release): its exit code (143 on SIGTERM) is not a failure of the rank.
    failed = [(r, s) for r, s in present if s.phase == PodPhase.FAILED
              and (launched or not s.deleting)]
    vanished = [(r, PodState(name=pod_of[r.rank], phase="Failed", deleting=False,
                             exit_code=None, reason="PodDisappeared",
                             message="the pod is gone while its gang was running",
                             pod_ip=None, finished_at=None))
                for r in missing]
    lost = deleted or ([blame(failed)] if failed else []) or vanished
    if not lost:
        return False
    await _restart(ctx, plan, *lost[0], disrupted=False)
    return True


def blame(failed: list[tuple[RankPlan, PodState]]) -> tuple[RankPlan, PodState]:
    """The failed rank whose own error caused the others' (cephalo.rootcause): the earliest
    to finish whose termination message is not a collective echo ("Connection closed by
    peer", a timeout), so the status names the disk-full rank, not its peers."""
    ordered = sorted(failed, key=lambda f: (f[1].finished_at is None, f[1].finished_at or "",
                                            f[0].rank))
    chosen = root_cause([
        RankFailure(rank=i, exit_code=255 if s.exit_code is None else s.exit_code,
                    log_tail=s.message or "")
        for i, (_, s) in enumerate(ordered)])
    return ordered[chosen.rank]


async def _report(ctx: JobContext, plan: Plan, states: list[PodState]) -> None:
    status = ctx.status
    if all(s.phase == PodPhase.SUCCEEDED for s in states):
        # 'all 1 ranks completed' read oddly in `cephalo submit --watch` (the README walk)
        message = "1 rank completed" if plan.world_size == 1 else \
            f"all {plan.world_size} ranks completed"
        final = final_progress(ctx, states[0].message, states[0].uid)  # rank 0's, as it ended
        last = {"progress": final} if final is not None else {}
        ctx.event("Normal", "Succeeded", message + _trained(final))
        await ctx.write_status(JobPhase.SUCCEEDED, message, {
            SUCCEEDED: ("True", "Completed", message),
            RUNNING: ("False", "Completed", message)}, completionTime=now_iso(ctx.now),
            **last)
        await stop_unfinished(ctx)  # a profiler of a pool the job might have grown onto
        return
    if all(s.phase in (PodPhase.RUNNING, PodPhase.SUCCEEDED) for s in states):
        fields: dict[str, Any] = {}
        progress = await _progress(ctx, states[0].pod_ip, states[0].uid)
        if progress is not None:
            fields["progress"] = progress
            rescale.measure_restart(ctx, progress)  # the new plan's first step, if rescaling
        message = f"{plural(plan.world_size, 'rank')} running"
        if status.get("phase") != JobPhase.RUNNING:
            ctx.event("Normal", "Running", message)
        await ctx.write_status(JobPhase.RUNNING, message, {
            RUNNING: ("True", "AllRanksRunning", message), **_resumed(status)}, **fields)
        ctx.wake_in(min(ctx.config.recheck_seconds, ctx.config.progress_interval_seconds))
        return
    running = sum(s.phase == PodPhase.RUNNING for s in states)
    phase = (JobPhase.RESTARTING if status.get("phase") == JobPhase.RESTARTING
             else JobPhase.PENDING)
    await ctx.write_status(phase, f"waiting for ranks: {running}/{plan.world_size} running",
                           _resumed(status))
    ctx.wake_in(ctx.config.recheck_seconds)


def _trained(final: dict[str, Any] | None) -> str:
    """`; step 30/30, loss 4.3186, 812.5 samples/s` for the Succeeded Event (the status
    message stays as it was: `cephalo submit --watch` adds the step and loss to it)."""
    if final is None:
        return ""
    parts = [f"step {final['step']}/{final['totalSteps']}"]
    if final.get("loss") is not None:
        parts.append(f"loss {final['loss']:.4f}")
    if final.get("samplesPerSecond") is not None:
        parts.append(f"{final['samplesPerSecond']:.1f} samples/s")
    return "; " + ", ".join(parts)


def _resumed(status: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    suspended = any(c["type"] == SUSPENDED and c["status"] == "True"
                    for c in status.get("conditions") or [])
    if not suspended:
        return {}
    return {SUSPENDED: ("False", "Resumed", "resumed from the last checkpoint")}


async def _restart(ctx: JobContext, plan: Plan, rank: RankPlan, state: PodState, *,
                   disrupted: bool) -> None:
    """Record a gang restart (or the end of the job); the ranks go once that is written."""
    status = ctx.status
    pool = rank.pool or rank.gpu

    async def stop_ranks() -> None:
        # the next pass sees survivors as stale anyway; this is sooner
        for pod in dict.fromkeys(rank_pod_names(ctx.job, plan).values()):
            await ctx.kube.delete(core_path(ctx.namespace, "pods", pod))

    if disrupted:
        count = int(status.get("preemptions") or 0) + 1
        message = (f"rank {rank.rank} (pool {pool}, pod {state.name}) was disrupted "
                   f"({state.disruption}); all ranks restart from the last checkpoint "
                   f"(disruption {count}, not counted toward backoffLimit)")
        ctx.event("Warning", "Preempted", message)
        await ctx.write_status(JobPhase.RESTARTING, message, {
            RUNNING: ("False", "RankDisrupted", message)}, preemptions=count)
        ctx.after_write(lambda: _count(metrics.PREEMPTIONS, ctx))
        ctx.after_write(stop_ranks)
        ctx.wake_in(ctx.config.recheck_seconds)
        return
    summary = failure_summary(rank.rank, pool, state)
    restarts, limit = int(status.get("restarts") or 0), ctx.job.spec.backoff_limit
    if restarts < limit:
        message = (f"gang restart {restarts + 1}/{limit}: {summary}; all ranks restart from "
                   "the last checkpoint")
        ctx.event("Warning", "GangRestart", message)
        await ctx.write_status(JobPhase.RESTARTING, message, {
            RUNNING: ("False", "RankFailed", summary)}, restarts=restarts + 1)
        ctx.after_write(lambda: _count(metrics.RESTARTS, ctx))
        ctx.after_write(stop_ranks)
        ctx.wake_in(ctx.config.recheck_seconds)
        return
    message = f"{summary} (backoffLimit {limit} reached after {restarts} restart(s))"
    ctx.event("Warning", "BackoffLimitExceeded", message)
    # The ranks still running are stopped once Failed is written (see stop_unfinished).
    await ctx.write_status(JobPhase.FAILED, message, {
        RUNNING: ("False", "RankFailed", summary),
        FAILED: ("True", "BackoffLimitExceeded", message)}, completionTime=now_iso(ctx.now))


async def _count(counter: Any, ctx: JobContext) -> None:
    counter.labels(ctx.namespace, ctx.name).inc()


async def stop_unfinished(ctx: JobContext) -> None:
    """Free the GPUs of ranks still waiting on a failed gang, of a profiler still measuring
    a pool for elastic growth (elastic_profiling.py) and of a network probe still running
    beside the gang (netprobe_background.py) when the job finished; keep finished pods for
    logs."""
    pods_path = core_path(ctx.namespace, "pods")
    for pod in await ctx.kube.list(pods_path, f"{LABEL_JOB}={ctx.name},"
                                   f"{LABEL_ROLE} in (trainer,profiler,netprobe)"):
        if (owned_by(pod, ctx.uid) and pod_state(pod).phase not in POD_DONE
                and not pod["metadata"].get("deletionTimestamp")):
            await ctx.kube.delete(f"{pods_path}/{pod['metadata']['name']}",
                                  pod["metadata"]["uid"])
