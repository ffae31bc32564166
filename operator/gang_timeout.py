"""Pending timeout without a gang scheduler (`spec.schedulingPolicy.scheduleTimeoutSeconds`).

The default scheduler places rank pods one at a time: two jobs can each hold part of their
gang and wait forever for the rest. With no gang scheduler in charge (no Kueue queue label,
no Volcano or coscheduling: `gang.gang_scheduler(job) == "none"`), the operator releases the
whole gang when a rank pod of the current attempt has stayed unscheduled (Pending with no
`spec.nodeName`) longer than the timeout: it deletes the pending *and* running ranks, posts a
`GangReleased` Event, deletes the plan and re-plans on the GPUs that are free then. A release
is not a failure: it counts toward neither `backoffLimit` nor `status.restarts`.

Timed on the operator's own clock, never the API server's: the condition `RanksScheduled`
turns Unknown (reason `RanksCreated`) in the pass that creates the attempt's pods, False
(reason `Unschedulable`) in the first pass that sees one of them unscheduled, and the
timeout runs from that False transition (its lastTransitionTime, written by this operator).
A new attempt, plan or release resets it. Unset (the default): no timeout, ranks wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cephalo.api import Plan
from cephalo.operator import metrics
from cephalo.operator.gang import gang_scheduler
from cephalo.operator.gpu_usage import PODS
from cephalo.operator.kube import core_path
from cephalo.operator.render import plan_config_map_name, rank_pod_names
from cephalo.operator.status import PLANNED, JobPhase, parse_time

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

RANKS_SCHEDULED = "RanksScheduled"  # condition type
MESSAGE_CHARS = 300


def schedule_timeout_seconds(ctx: JobContext) -> int | None:
    """The timeout the operator enforces itself; None when unset or a gang scheduler
    (Kueue, Volcano, coscheduling) admits the gang (they time it themselves)."""
    policy = ctx.job.spec.scheduling_policy
    if policy is None or policy.schedule_timeout_seconds is None:
        return None
    return policy.schedule_timeout_seconds if gang_scheduler(ctx.job) == "none" else None


def unscheduled(pod: dict[str, Any]) -> bool:
    return (not pod["metadata"].get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
            and not (pod.get("spec") or {}).get("nodeName"))


def unscheduled_reason(pod: dict[str, Any]) -> str:
    """Why the pod waits: its scheduling gates (Kueue's admission gate), else the
    scheduler's own words (PodScheduled=False), e.g. "0/8 nodes are available: …"."""
    gates = [g.get("name", "") for g in (pod.get("spec") or {}).get("schedulingGates") or []]
    if gates:
        return f"held by scheduling gate(s) {', '.join(gates)}"[:MESSAGE_CHARS]
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            text = c.get("message") or c.get("reason") or ""
            return text[:MESSAGE_CHARS]
    return "not scheduled yet"


def _since(ctx: JobContext) -> float | None:
    """When the current Unschedulable stretch began (operator clock), None if not in one."""
    for c in ctx.status.get("conditions") or []:
        if c.get("type") == RANKS_SCHEDULED and c.get("status") == "False":
            return parse_time(c.get("lastTransitionTime"))
    return None


async def check(ctx: JobContext, plan: Plan, pods: dict[str, dict[str, Any]],
                created_now: bool) -> bool:
    """Track the attempt's scheduling; release the gang past the timeout (True: released,
    the pass has nothing more to do)."""
    timeout = schedule_timeout_seconds(ctx)
    if timeout is None:
        return False
    phase, message = ctx.phase or JobPhase.PENDING, ctx.status.get("message") or ""
    if created_now:  # the clock starts when a pass first sees these pods unscheduled
        await ctx.write_status(phase, message, {RANKS_SCHEDULED: (
            "Unknown", "RanksCreated", "rank pods of this attempt created")})
        return False
    pod_of = rank_pod_names(ctx.job, plan)  # a pod of several ranks: each of its ranks waits
    waiting = [(r.rank, pod) for r in plan.ranks
               if (pod := pods.get(pod_of[r.rank])) is not None
               and unscheduled(pod)]
    if not waiting:
        await ctx.write_status(phase, message, {RANKS_SCHEDULED: (
            "True", "AllRanksScheduled", f"all {plan.world_size} rank pods are on nodes")})
        return False
    ranks = ", ".join(str(rank) for rank, _ in waiting)
    why = unscheduled_reason(waiting[0][1])
    since = _since(ctx)
    if since is None or ctx.now - since < timeout:
        ctx.wake_in(timeout - (0.0 if since is None else ctx.now - since))
        await ctx.write_status(phase, message, {RANKS_SCHEDULED: (
            "False", "Unschedulable", f"rank(s) {ranks} not scheduled: {why} (the gang is "
            f"released after scheduleTimeoutSeconds {timeout})")})
        return False
    await _release(ctx, plan, pods, ranks, why, ctx.now - since, timeout)
    return True


async def _release(ctx: JobContext, plan: Plan, pods: dict[str, dict[str, Any]], ranks: str,
                   why: str, waited_seconds: float, timeout: int) -> None:
    message = (f"rank(s) {ranks} unscheduled for {waited_seconds:.0f} s (scheduleTimeoutSeconds "
               f"{timeout}): {why}; released all {plan.world_size} ranks to re-plan on the "
               "GPUs that are free (not counted toward backoffLimit)")
    ctx.event("Warning", "GangReleased", message)
    # launchedAttempt cleared: the ranks about to go are not lost ranks of a running gang.
    await ctx.write_status(JobPhase.PENDING, message, {
        RANKS_SCHEDULED: ("Unknown", "GangReleased", message),
        PLANNED: ("False", "GangReleased", message)}, launchedAttempt=None)

    async def release() -> None:  # only once the status write took effect
        metrics.GANG_RELEASES.labels(ctx.namespace, ctx.name).inc()
        cm_path = core_path(ctx.namespace, "configmaps")
        await ctx.kube.delete(f"{cm_path}/{plan_config_map_name(ctx.job)}")  # → re-plan
        # pending and running alike: the whole gang lets go
        for name in dict.fromkeys(rank_pod_names(ctx.job, plan).values()):
            pod = pods.get(name)
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                await ctx.kube.delete(core_path(ctx.namespace, "pods", pod["metadata"]["name"]),
                                      pod["metadata"].get("uid"))
        PODS.invalidate()

    ctx.after_write(release)
    ctx.wake_in(ctx.config.recheck_seconds)
