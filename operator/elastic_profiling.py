"""Elastic growth onto a pool without a cached profile (issue 39 item 1).

A job often starts while another workload holds some GPUs; when they are freed, the pool
they are in may never have been profiled for the job's model. The elastic decision
(rescale.py) needs a profile to plan on it, so before deciding, the job profiles that pool
itself: one profiler pod on one of the freed GPUs, while the gang trains on untouched (no
drain, no restart). The GPU is held for the profiler in `CLAIMS` (`hold_profiler`), so no
other job plans on it meanwhile; status.elastic.lastDecision says "profiling POOL before
deciding". Once the profile is cached the normal decision runs on the whole offer.

One pool is profiled at a time (the first by product name). The attempts are those of the
first profiling (profile_timeout_seconds, profile_retries, counted in the job's annotation);
a pool whose attempts all failed is recorded in status.elastic.profileFailures and left out
of the offer for a backoff (cooldownSeconds, doubled with each failure, at most a day),
its attempt count reset so that a later re-plan is not failed for it. A profiler failure
never fails the running job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cephalo.api import GpuProfile
from cephalo.operator.discovery import Pool
from cephalo.operator.gpu_usage import CLAIMS
from cephalo.operator.profiling import (
    ProfilingFailed,
    ensure_spec_config_map,
    profile_attempts,
    profile_one,
    save_attempts,
)
from cephalo.operator.status import now_iso, parse_time

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")
FAILURES = "profileFailures"  # status.elastic field: product -> the last failure
MAX_BACKOFF_SECONDS = 86_400.0


@dataclass
class Profiling:
    """What profiling the missing pools gave this pass."""

    profiles: dict[str, GpuProfile] = field(default_factory=dict)  # measured now, by catalog name
    waiting: Pool | None = None  # its profiler still runs: decide after it
    left_out: list[Pool] = field(default_factory=list)  # failed or backing off: plan without


def backoff_seconds(failures: int, cooldown_seconds: float) -> float:
    """The wait before a pool whose profiling failed `failures` times is tried again."""
    return min(MAX_BACKOFF_SECONDS, max(1.0, cooldown_seconds) * 2 ** max(0, failures - 1))


def backing_off(elastic: dict[str, Any], product: str, now: float) -> bool:
    retry = parse_time(((elastic.get(FAILURES) or {}).get(product) or {}).get("retryTime"))
    return retry is not None and now < retry


async def profile_missing(ctx: JobContext, missing: list[Pool],
                          elastic: dict[str, Any]) -> Profiling:
    """Profile the first of `missing` not backing off; `elastic` (the status.elastic the
    caller records) gets the failures. Holds the profiler's GPU while it runs."""
    assert ctx.job.spec.elastic is not None
    key = (ctx.namespace, ctx.name)
    result = Profiling()
    attempts: dict[str, int] | None = None
    for pool in sorted(missing, key=lambda p: p.product):
        if result.waiting is not None:
            break  # one profiler at a time: the others wait for the next decision
        if backing_off(elastic, pool.product, ctx.now):
            result.left_out.append(pool)
            continue
        if attempts is None:
            CLAIMS.hold_profiler(key, ctx.uid, pool.product)  # before the first await
            await ensure_spec_config_map(ctx)
            attempts = profile_attempts(ctx)
        try:
            profile = await profile_one(ctx, pool, attempts)
        except ProfilingFailed as err:
            _failed(ctx, elastic, pool, str(err))
            attempts.pop(pool.product, None)  # a later re-plan starts counting afresh
            await save_attempts(ctx, attempts)
            result.left_out.append(pool)
            continue
        if profile is None:
            result.waiting = pool
            CLAIMS.hold_profiler(key, ctx.uid, pool.product)
        else:
            result.profiles[pool.catalog_name or pool.product] = profile
            failures = dict(elastic.get(FAILURES) or {})
            if failures.pop(pool.product, None) is not None:
                elastic[FAILURES] = failures
    if result.waiting is None:
        CLAIMS.release_profiler(key)
    else:
        ctx.wake_in(ctx.config.recheck_seconds)  # look at the profiler pod again
    return result


def _failed(ctx: JobContext, elastic: dict[str, Any], pool: Pool, why: str) -> None:
    spec = ctx.job.spec
    assert spec.elastic is not None
    failures = dict(elastic.get(FAILURES) or {})
    count = int((failures.get(pool.product) or {}).get("failures") or 0) + 1
    wait = backoff_seconds(count, spec.elastic.cooldown_seconds)
    failures[pool.product] = {"failures": count, "time": now_iso(ctx.now),
                              "retryTime": now_iso(ctx.now + wait), "reason": why}
    elastic[FAILURES] = failures
    message = (f"{why}; {pool.product} is left out of elastic growth for {wait:.0f} s "
               "(the job trains on)")
    ctx.event("Warning", "ElasticProfilingFailed", message)
    log.warning("%s/%s: %s", ctx.namespace, ctx.name, message)


__all__ = ["FAILURES", "Profiling", "backing_off", "backoff_seconds", "profile_missing"]
