"""Gang admission I/O: the PodGroup (Volcano, coscheduling) before the rank pods.

The objects come from the pure builders in `cephalo.operator.gang`; this module only
applies them, idempotently: the PodGroup has a deterministic name (job, attempt, plan hash),
is created if absent and counts only when its controller ownerReference is this job's uid;
PodGroups of an earlier attempt or plan (or an older job of the same name) are deleted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cephalo.api import Plan
from cephalo.operator.gang import group_name, pod_group_api, pod_groups_path, render_pod_group
from cephalo.operator.kube import not_owned, owned_by
from cephalo.operator.render import LABEL_JOB, config_hash, owner_reference, render
from cephalo.operator.training import attempt_of

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext


async def ensure_pod_group(ctx: JobContext, plan: Plan) -> None:
    """Create the current attempt's PodGroup (Volcano or coscheduling) before its rank pods,
    and delete the job's stale ones. Nothing for Kueue or no gang scheduler."""
    api = pod_group_api(ctx.job)
    if api is None:
        return
    attempt, digest = attempt_of(ctx.status), config_hash(ctx.job, plan)
    group = group_name(ctx.name, attempt, digest)
    pods = render(ctx.job, plan, ctx.config, attempt=attempt)[2:]
    wanted = render_pod_group(ctx.job, pods, group=group, owner=owner_reference(ctx.job))
    assert wanted is not None
    path = pod_groups_path(api, ctx.namespace)
    present = False
    for old in await ctx.kube.list(path, f"{LABEL_JOB}={ctx.name}"):
        meta = old["metadata"]
        if meta["name"] == group and owned_by(old, ctx.uid) and not meta.get("deletionTimestamp"):
            present = True  # one LIST a pass when nothing changed, no create round trip
        elif not meta.get("deletionTimestamp"):
            await ctx.kube.delete(f"{path}/{meta['name']}", meta["uid"])
    if present:
        return
    created, _ = await ctx.kube.create(path, wanted)
    if not owned_by(created, ctx.uid):  # an older job's namesake: delete it, wait for it
        await ctx.kube.delete(f"{path}/{created['metadata']['name']}",
                              created["metadata"]["uid"])
        raise not_owned(created)


async def delete_pod_groups(ctx: JobContext) -> None:
    """Remove the job's PodGroups (suspend, finish): an Inqueue Volcano PodGroup keeps its
    minResources reserved in the queue even when its pods are gone."""
    api = pod_group_api(ctx.job)
    if api is None:
        return
    path = pod_groups_path(api, ctx.namespace)
    for old in await ctx.kube.list(path, f"{LABEL_JOB}={ctx.name}"):
        if owned_by(old, ctx.uid) and not old["metadata"].get("deletionTimestamp"):
            await ctx.kube.delete(f"{path}/{old['metadata']['name']}", old["metadata"]["uid"])


__all__ = ["delete_pod_groups", "ensure_pod_group"]
