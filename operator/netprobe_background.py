"""A link never measured, probed beside the running gang (issue 46 item 8; docs/network.md).

A job re-planned after it lost GPUs plans at once with what the cache knows
(netprobe.measure): a link whose pool's NIC was never measured is priced from the node label
or the assumed figure, condition NetworkMeasured False, reason NotMeasured. Once the new gang
runs, that probe runs beside it, never in its way:

* only on GPUs free of *every* pod, the job's own ranks included (gpu_usage with no job
  exempt, other jobs' planned GPUs left to them): the gang never waits for the probe, and
  the probe never waits for the gang's GPUs (netprobe_choice.background_probe, pure);
* one probe at a time, bounded by CEPHALO_NETWORK_PROBE_TIMEOUT_SECONDS like any probe; a
  failure is recorded in the job's annotation and never tried again (reason ProbeFailed);
* its pods go as soon as the gang is not running (a gang restart, a re-plan, a rescale) and
  when the job ends (training.stop_unfinished); it starts again once a gang runs.

What it measures is cached like any probe (every job on those pools reuses it). The plan in
force is kept: the next re-plan calibration (replan.py prices the links from the cache)
adopts a plan from the measurement only through the usual gain rule (elastic.decide). With
no free GPUs nothing runs; the condition says so, and the next pass looks again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cephalo.api import ClusterSpec, GpuGroup, Plan
from cephalo.api.network_profile import NetworkProfile
from cephalo.operator import rescale
from cephalo.operator.discovery import Pool, discover_pools, job_tolerations
from cephalo.operator.gpu_usage import CLAIMS, PODS, free_pools, gpu_usage
from cephalo.operator.kube import core_path
from cephalo.operator.netprobe import (
    NETWORK_MEASURED,
    NOT_MEASURED,
    cached_all,
    delete_probes,
    failed_probes,
    record_failure,
    run_probe,
)
from cephalo.operator.netprobe_choice import (
    answer,
    background_probe,
    nic_identities,
    probes_needed,
)
from cephalo.operator.render import LABEL_JOB, LABEL_NETPROBE, LABEL_ROLE
from cephalo.operator.status import JobPhase

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")
MEASURING = "MeasuringBesideTheGang"  # condition reason: a probe runs beside the ranks
PROBE_FAILED = "ProbeFailed"  # as netprobe.measure says it: never tried again


def unmeasured(status: dict[str, Any]) -> str | None:
    """The NetworkMeasured reason when a link is left to measure beside the gang (a re-plan
    left it, or a probe runs for it); else None (measured, failed, or never looked at)."""
    for c in status.get("conditions") or []:
        if c.get("type") == NETWORK_MEASURED and c.get("status") == "False" and \
                c.get("reason") in (NOT_MEASURED, MEASURING):
            return str(c["reason"])
    return None


async def probe_beside(ctx: JobContext, nodes: list[dict[str, Any]], plan: Plan) -> None:
    """After train(): start, watch or stop the probe of a link the job's plan left
    unmeasured. Nothing at all (no API call) for a job whose links are known."""
    reason = unmeasured(ctx.status)
    if reason is None or not ctx.config.network_probe:
        return
    if ctx.phase != JobPhase.RUNNING or rescale.rescaling(ctx):
        if reason == MEASURING:  # the GPUs are the gang's again: never in its way
            await delete_probes(ctx)
        if reason == MEASURING and not ctx.has_condition(NETWORK_MEASURED):  # a re-plan's wins
            ctx.condition(NETWORK_MEASURED, "False", NOT_MEASURED, "the probe beside the gang "
                          "was stopped (the gang is not running); it runs again once it is")
        return
    used = rescale.plan_pools(plan)
    tolerations = job_tolerations(ctx.job.spec)
    # The pools as the job's re-plan saw them (its own pods free to it): the same NIC
    # identities, so the same probes.
    mine = await free_pools(ctx.kube, (ctx.namespace, ctx.name), ctx.uid, nodes, tolerations)
    pools = [p for p in mine.pools if p.product in used]
    cluster = ClusterSpec(groups=[GpuGroup(product=p.catalog_name or p.product,
                                           count=used[p.product], pool=p.product)
                                  for p in pools])
    probes = probes_needed(ctx.job.spec, cluster, pools, nic_identities(pools, nodes))
    cached = await cached_all(ctx)
    known = answer(probes, cached, now=ctx.now, max_age_seconds=float("inf"))
    failed = failed_probes(ctx)
    pods = await ctx.kube.list(core_path(ctx.namespace, "pods"),
                               f"{LABEL_JOB}={ctx.name},{LABEL_ROLE}=netprobe")
    running = frozenset(str(p["metadata"]["labels"].get(LABEL_NETPROBE)) for p in pods
                        if not p["metadata"].get("deletionTimestamp"))
    choice = background_probe(known.to_probe, failed, await _free_of_all(ctx, nodes), running)
    if choice.probe is not None and choice.probe.digest not in running:
        # About to take GPUs: from a pod LIST made now (the shared one may predate the
        # gang's pods on their nodes).
        choice = background_probe(known.to_probe, failed,
                                  await _free_of_all(ctx, nodes, fresh=True), running)
    if running and (choice.probe is None or choice.probe.digest not in running):
        await delete_probes(ctx)  # its link was answered meanwhile (another job measured it)
    left = dict(choice.left)
    if choice.probe is not None:
        probe = choice.probe
        outcome = await run_probe(ctx, probe)
        if outcome is None:
            ctx.condition(NETWORK_MEASURED, "False", MEASURING, _joined({
                probe.describe(): "probe running beside the gang on free GPUs", **left}))
            return
        if isinstance(outcome, str):
            await record_failure(ctx, failed, probe, outcome,
                                 "the job trains on with the figure it planned with")
            left[probe.describe()] = f"probe failed: {outcome}"
        else:
            cached.append(outcome)
            known = answer(probes, cached, now=ctx.now, max_age_seconds=float("inf"))
            left = {what: why for what, why in left.items()
                    if what in {p.describe() for p in known.to_probe}}
            log.info("%s/%s: measured beside the gang: %s", ctx.namespace, ctx.name,
                     outcome.describe(ctx.now))
        ctx.wake_in(0.0)  # the next link, if any, on the next pass
    _say(ctx, known.measured, left)


def _say(ctx: JobContext, measured: list[NetworkProfile], left: dict[str, str]) -> None:
    if not left:
        ctx.condition(NETWORK_MEASURED, "True", "Measured", (
            "; ".join(p.describe(ctx.now) for p in measured) + "; measured beside the running "
            "gang (the plan in force priced these links from node labels or the assumed "
            "figure; the next re-plan calibration prices them as measured)")[:1000])
        return
    failed_only = all(why.startswith("probe failed") for why in left.values())
    ctx.condition(NETWORK_MEASURED, "False", PROBE_FAILED if failed_only else NOT_MEASURED,
                  _joined(left))


def _joined(left: dict[str, str]) -> str:
    return "; ".join(f"{what}: {why}" for what, why in left.items())[:1000]


async def _free_of_all(ctx: JobContext, nodes: list[dict[str, Any]], *,
                       fresh: bool = False) -> list[Pool]:
    """The pools as free of every pod and of every job's planned GPUs, this job's own
    included (no job is exempt: uid "" owns nothing)."""
    pods = await PODS.pods(ctx.kube, CLAIMS.namespaces | {ctx.namespace}, fresh=fresh)
    usage = gpu_usage(pods, "", CLAIMS.others(""), nodes)
    return discover_pools(nodes, usage, job_tolerations(ctx.job.spec)).pools


__all__ = ["MEASURING", "probe_beside", "unmeasured"]
