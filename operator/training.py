"""Train and watch: rank pods up, phase from their states, gang restarts, progress.

Progress: the operator scrapes rank 0's `/metrics` (the Prometheus port every rank serves
anyway) over HTTP and copies step, loss and samples/s into status.progress. Trainer pods
need no Kubernetes credentials for this (their service-account token is not even mounted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp
import kopf

from cephalo.api import Plan
from cephalo.operator import metrics
from cephalo.operator.kube import core_path
from cephalo.operator.render import (
    ANNOTATION_CONFIG_HASH,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_ROLE,
    config_hash,
    rank_pod_name,
    render,
)
from cephalo.operator.status import (
    FAILED,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    PodState,
    failure_summary,
    now_iso,
    parse_progress,
    parse_time,
    pod_state,
)

if TYPE_CHECKING:
    from cephalo.operator.reconcile import JobContext

SCRAPE_TIMEOUT_SECONDS = 3.0


async def train(ctx: JobContext, plan: Plan) -> None:
    job, status = ctx.job, ctx.status
    attempt = int(status.get("restarts") or 0)
    digest = config_hash(job, plan)
    objects = render(job, plan, ctx.config, attempt=attempt)
    pods_path = core_path(ctx.namespace, "pods")
    await ctx.kube.create(core_path(ctx.namespace, "services"), objects[1])
    pods = await ctx.kube.list(pods_path, f"{LABEL_JOB}={ctx.name},{LABEL_ROLE}=trainer")
    by_name = {p["metadata"]["name"]: p for p in pods}
    stale = [p for p in pods if p["metadata"].get("annotations", {}).get(
        ANNOTATION_CONFIG_HASH) != digest or p["metadata"]["labels"].get(LABEL_ATTEMPT)
        != str(attempt) or p["metadata"]["name"] not in {o["metadata"]["name"] for o in objects}]
    if stale or any(p["metadata"].get("deletionTimestamp") for p in pods):
        for pod in stale:
            if not pod["metadata"].get("deletionTimestamp"):
                await ctx.kube.delete(f"{pods_path}/{pod['metadata']['name']}")
        phase = "Restarting" if attempt > 0 else "Pending"
        await ctx.write_status(phase, f"replacing {len(stale) or len(pods)} rank pod(s) of an "
                               "earlier attempt or plan", _resumed(status))
        ctx.wake_in(ctx.config.recheck_seconds)
        return
    missing = [r for r in plan.ranks if rank_pod_name(job, r.rank) not in by_name]
    if missing and any(pod_state(p).phase != "Pending" for p in pods):
        # A rank vanished (deleted, evicted, node gone) while its gang ran: the others are
        # stuck in collectives with it, so this is a rank failure, not a pod to top up.
        gone = PodState(name=rank_pod_name(job, missing[0].rank), phase="Failed", deleting=False,
                        exit_code=None, reason="PodDisappeared",
                        message="the pod was deleted or evicted while its gang was running",
                        pod_ip=None, finished_at=None)
        await _on_failure(ctx, plan, [(missing[0], gone)], attempt)
        return
    for obj in objects[2:]:
        if obj["metadata"]["name"] not in by_name:
            created, _ = await ctx.kube.create(pods_path, obj)
            by_name[obj["metadata"]["name"]] = created
    states = [pod_state(by_name[rank_pod_name(job, r.rank)]) for r in plan.ranks]
    failed = [(r, s) for r, s in zip(plan.ranks, states, strict=True) if s.phase == "Failed"]
    if failed:
        await _on_failure(ctx, plan, failed, attempt)
        return
    if all(s.phase == "Succeeded" for s in states):
        message = f"all {plan.world_size} ranks completed"
        kopf.event(ctx.body, type="Normal", reason="Succeeded", message=message)
        await ctx.write_status("Succeeded", message, {
            SUCCEEDED: ("True", "Completed", message),
            RUNNING: ("False", "Completed", message)}, completionTime=now_iso(ctx.now))
        return
    if all(s.phase in ("Running", "Succeeded") for s in states):
        fields: dict[str, Any] = {}
        if not status.get("startTime"):
            fields["startTime"] = now_iso(ctx.now)
        progress = await _progress(ctx, states[0].pod_ip)
        if progress is not None:
            fields["progress"] = progress
        message = f"{plan.world_size} ranks running"
        if status.get("phase") != "Running":
            kopf.event(ctx.body, type="Normal", reason="Running", message=message)
        await ctx.write_status("Running", message, {RUNNING: ("True", "AllRanksRunning", message),
                                                    **_resumed(status)}, **fields)
        ctx.wake_in(min(ctx.config.recheck_seconds, ctx.config.progress_interval_seconds))
        return
    running = sum(s.phase == "Running" for s in states)
    phase = "Restarting" if status.get("phase") == "Restarting" else "Pending"
    await ctx.write_status(phase, f"waiting for ranks: {running}/{plan.world_size} running",
                           _resumed(status))
    ctx.wake_in(ctx.config.recheck_seconds)


def _resumed(status: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    suspended = any(c["type"] == SUSPENDED and c["status"] == "True"
                    for c in status.get("conditions") or [])
    if not suspended:
        return {}
    return {SUSPENDED: ("False", "Resumed", "resumed from the last checkpoint")}


async def _on_failure(ctx: JobContext, plan: Plan, failed: list, attempt: int) -> None:
    rank, state = failed[0]
    summary = failure_summary(rank.rank, rank.pool or rank.gpu, state)
    limit = ctx.job.spec.backoff_limit
    pods_path = core_path(ctx.namespace, "pods")
    if attempt < limit:
        message = (f"gang restart {attempt + 1}/{limit}: {summary}; all ranks restart from "
                   "the last checkpoint")
        kopf.event(ctx.body, type="Warning", reason="GangRestart", message=message)
        metrics.RESTARTS.labels(ctx.namespace, ctx.name).inc()
        # Record the new attempt first: if we crash after this, the next pass sees every
        # existing pod as stale and finishes the replacement.
        await ctx.write_status("Restarting", message, {
            RUNNING: ("False", "RankFailed", summary)}, restarts=attempt + 1)
        for r in plan.ranks:
            await ctx.kube.delete(f"{pods_path}/{rank_pod_name(ctx.job, r.rank)}")
        ctx.wake_in(ctx.config.recheck_seconds)
        return
    message = f"{summary} (backoffLimit {limit} reached after {attempt} restart(s))"
    kopf.event(ctx.body, type="Warning", reason="BackoffLimitExceeded", message=message)
    await ctx.write_status("Failed", message, {RUNNING: ("False", "RankFailed", summary),
                                               FAILED: ("True", "BackoffLimitExceeded", message)},
                           completionTime=now_iso(ctx.now))
    # Free the GPUs of ranks still waiting on the dead one; keep terminated pods for logs.
    for r in plan.ranks:
        pod = await ctx.kube.get(f"{pods_path}/{rank_pod_name(ctx.job, r.rank)}")
        if pod is not None and pod_state(pod).phase not in ("Failed", "Succeeded"):
            await ctx.kube.delete(f"{pods_path}/{pod['metadata']['name']}")


async def _progress(ctx: JobContext, pod_ip: str | None) -> dict[str, Any] | None:
    """Scrape rank 0 when the last update is older than the progress interval."""
    last = parse_time((ctx.status.get("progress") or {}).get("lastUpdateTime"))
    if pod_ip is None or (last is not None
                          and ctx.now - last < ctx.config.progress_interval_seconds):
        return None
    url = f"http://{pod_ip}:{ctx.config.trainer_metrics_port}/metrics"
    try:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None  # rank 0 not serving yet; try again next pass
    progress = parse_progress(text)
    if not progress:
        return None
    progress["totalSteps"] = progress.get("totalSteps", ctx.job.spec.training.steps)
    progress["lastUpdateTime"] = now_iso(ctx.now)
    if "samplesPerSecond" in progress:
        metrics.MEASURED_SAMPLES.labels(ctx.namespace, ctx.name).set(progress["samplesPerSecond"])
    return progress
