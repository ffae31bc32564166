"""Profiling step: one profiler pod per GPU product without a cached profile, and one more
for the micro-batch sizes a plan assigns beyond the profiled ones (`measure_beyond`).

Results are cached in ConfigMaps `cephalo-profile-<product>-<model hash>` in the job's
namespace (not owned by the job: later jobs with the same model reuse them). Attempts are
counted in a job annotation, so an operator restart neither forgets nor repeats them.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cephalo.api import GpuProfile
from cephalo.api.profile import merge_points
from cephalo.operator import metrics
from cephalo.operator.discovery import Pool
from cephalo.operator.kube import core_path, job_path, not_owned, owned_by
from cephalo.operator.render import (
    ANNOTATION_PROFILE_ATTEMPTS,
    ANNOTATION_PROFILE_EXTRA_SIZES,
    LABEL_JOB,
    LABEL_PROFILE,
    LABEL_ROLE,
    PROFILE_KEY,
    profile_config_map_name,
    profiler_pod_name,
    render_profiler_pod,
    render_spec_config_map,
)
from cephalo.operator.status import (
    PROFILED,
    JobPhase,
    PodPhase,
    parse_time,
    pod_state,
    tail,
)
from cephalo.planner.feedback.measured_sizes import (
    MAX_MEASURE_ROUNDS,
    describe_unmeasured,
    size_list,
)

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

# When the operator created a profiler pod, by its own clock: the timeout is measured on
# that clock, never against the API server's creationTimestamp (clocks may disagree).
ANNOTATION_STARTED = "cephalo.dev/created-at-seconds"


class ProfilingFailed(Exception):
    """A product's profiler failed every attempt; the message says which and why."""


async def _cached(ctx: JobContext, catalog_name: str,
                  micro_batch_sizes: list[int] | None = None) -> GpuProfile | None:
    """The product's cached profile (of an extra pass's sizes when given), else None."""
    name = profile_config_map_name(catalog_name, ctx.job, ctx.config, micro_batch_sizes)
    cm = await ctx.kube.get(core_path(ctx.namespace, "configmaps", name))
    try:
        return GpuProfile.model_validate_json((cm or {}).get("data", {}).get(PROFILE_KEY, ""))
    except ValidationError:
        return None


async def cached_profiles(ctx: JobContext, pools: list[Pool]) -> tuple[dict[str, GpuProfile],
                                                                        list[Pool]]:
    """The pools' cached profiles, each with the points of the extra passes measured for it
    (the job's annotation), and the pools without one."""
    profiles, missing, _ = await _cached_with_passes(ctx, pools)
    return profiles, missing


async def _cached_with_passes(ctx: JobContext, pools: list[Pool]) -> tuple[
        dict[str, GpuProfile], list[Pool], list[tuple[Pool, list[int]]]]:
    """`cached_profiles`, and (pool, sizes) of each extra pass not cached yet: one pool of
    each product measures it. A pass is done once its cache entry exists, whatever sizes it
    delivered: a profiler that came back without a size it was asked for is not asked again
    (the planner then plans with what was measured, never in a loop)."""
    profiles: dict[str, GpuProfile] = {}
    missing: list[Pool] = []
    pending: list[tuple[Pool, list[int]]] = []
    passes = extra_passes(ctx)
    for pool in pools:
        assert pool.catalog_name is not None
        if pool.catalog_name in profiles:
            continue
        found = await _cached(ctx, pool.catalog_name)
        if found is None:
            missing.append(pool)
            continue
        for sizes in passes.get(pool.catalog_name, []):
            extra = await _cached(ctx, pool.catalog_name, sizes)
            if extra is None:
                pending.append((pool, sizes))
            else:
                found = merge_points(found, extra)
        profiles[pool.catalog_name] = found
    return profiles, missing, pending


async def profile(ctx: JobContext, pools: list[Pool]) -> dict[str, GpuProfile] | None:
    """All profiles, with every extra pass a plan asked for, or None while profiler pods
    are still running. Raises ProfilingFailed."""
    profiles, missing, pending = await _cached_with_passes(ctx, pools)
    if not missing and not pending:
        return profiles
    await ensure_spec_config_map(ctx)
    attempts = profile_attempts(ctx)
    waiting: list[str] = []
    for pool in missing:
        done = await profile_one(ctx, pool, attempts)
        if done is None:
            waiting.append(f"{pool.product} (attempt {attempts.get(pool.product, 0) + 1}/"
                           f"{ctx.config.profile_retries + 1})")
        else:
            profiles[pool.catalog_name or pool.product] = done
    if waiting:
        await ctx.write_status(JobPhase.PROFILING, f"profiling {', '.join(waiting)}", {
            PROFILED: ("False", "Profiling", "profiler pods running for " + ", ".join(waiting))})
        return None
    # Sizes a plan assigned beyond the profiled ones (measure_beyond): after the products'
    # first passes, whose profiles say what "beyond" is.
    wanted: dict[str, list[int]] = {}
    if missing:  # the products' first passes just came in: which extra passes they lack
        profiles, _, pending = await _cached_with_passes(ctx, pools)
    for pool, sizes in pending:
        assert pool.catalog_name is not None
        done = await profile_one(ctx, pool, attempts, sizes)
        if done is None:
            wanted[pool.catalog_name] = sizes
        else:
            profiles[pool.catalog_name] = merge_points(profiles[pool.catalog_name], done)
    if wanted:
        what = describe_unmeasured(wanted, profiles)
        await ctx.write_status(JobPhase.PROFILING, f"profiling {what}", {
            PROFILED: ("False", "ProfilingSizes", f"profiler pods running for {what}")})
        return None
    return profiles


def extra_passes(ctx: JobContext) -> dict[str, list[list[int]]]:
    """{GPU product: [sizes of each extra pass]} the job's plans asked for (its annotation)."""
    passes: dict[str, list[list[int]]] = _extra_state(ctx)["passes"]
    return passes


def _extra_state(ctx: JobContext) -> dict[str, Any]:
    text = (ctx.body["metadata"].get("annotations") or {}).get(ANNOTATION_PROFILE_EXTRA_SIZES)
    try:
        state = json.loads(text or "{}")
        return {"rounds": int(state.get("rounds", 0)), "passes": {
            str(k): [[int(m) for m in sizes] for sizes in v]
            for k, v in dict(state.get("passes", {})).items()}}
    except (ValueError, TypeError, AttributeError):  # edited by hand: start over
        return {"rounds": 0, "passes": {}}


async def measure_beyond(ctx: JobContext, wanted: dict[str, list[int]],
                         profiles: dict[str, GpuProfile]) -> bool:
    """A plan assigns the sizes `wanted` ({product: sizes}) beyond its profiles: ask for
    one extra profiler pass per product (the job's annotation; the next passes of
    `profile` run it) and say so. False when MAX_MEASURE_ROUNDS passes were asked for
    already: the plan is then used with what is measured."""
    state = _extra_state(ctx)
    if state["rounds"] >= MAX_MEASURE_ROUNDS:
        return False
    for product, sizes in wanted.items():
        state["passes"].setdefault(product, []).append(sizes)
    state["rounds"] += 1
    await ctx.kube.patch(job_path(ctx.namespace, ctx.name), {"metadata": {"annotations": {
        ANNOTATION_PROFILE_EXTRA_SIZES: json.dumps(state, sort_keys=True)}}})
    what = describe_unmeasured(wanted, profiles)
    ctx.event("Normal", "ProfilingSizes", f"the plan assigns {what}: measuring them before "
              f"it is used (round {state['rounds']} of at most {MAX_MEASURE_ROUNDS})")
    await ctx.write_status(JobPhase.PROFILING, f"profiling {what}", {
        PROFILED: ("False", "ProfilingSizes", f"the plan assigns {what}")})
    ctx.wake_in(0.0)
    return True


async def ensure_spec_config_map(ctx: JobContext) -> None:
    """The job's spec ConfigMap, which its profiler pods read, as the spec is now."""
    spec_cm = render_spec_config_map(ctx.job)
    existing, _ = await ctx.kube.create(core_path(ctx.namespace, "configmaps"), spec_cm)
    if not owned_by(existing, ctx.uid):  # an older job's: deleted, created again next pass
        await ctx.kube.delete(core_path(ctx.namespace, "configmaps", existing["metadata"]["name"]),
                              existing["metadata"]["uid"])
        raise not_owned(existing)
    if existing.get("data") != spec_cm["data"]:  # the spec changed while profiling
        await ctx.kube.patch(core_path(ctx.namespace, "configmaps", spec_cm["metadata"]["name"]),
                             {"data": spec_cm["data"]})


def profile_attempts(ctx: JobContext) -> dict[str, int]:
    """Failed profiler attempts per product, as the job's annotation counts them."""
    attempts: dict[str, int] = json.loads(
        (ctx.body["metadata"].get("annotations") or {}).get(ANNOTATION_PROFILE_ATTEMPTS, "{}"))
    return attempts


async def save_attempts(ctx: JobContext, attempts: dict[str, int]) -> None:
    await ctx.kube.patch(job_path(ctx.namespace, ctx.name), {"metadata": {"annotations": {
        ANNOTATION_PROFILE_ATTEMPTS: json.dumps(attempts, sort_keys=True)}}})


async def profile_one(ctx: JobContext, pool: Pool, attempts: dict[str, int],
                      micro_batch_sizes: list[int] | None = None) -> GpuProfile | None:
    """The pool's profile once its profiler pod succeeded; None while it runs (created
    here when there is none). A failed attempt is counted in `attempts` (and the job's
    annotation) and retried; raises ProfilingFailed after profile_retries retries.
    `micro_batch_sizes`: an extra pass for just those sizes (its own pod, attempts and
    cache entry)."""
    job, product = ctx.job, pool.product
    counted = product if micro_batch_sizes is None else \
        f"{product} sizes {','.join(map(str, micro_batch_sizes))}"
    attempt = attempts.get(counted, 0)
    pods_path = core_path(ctx.namespace, "pods")
    name = profiler_pod_name(job, product, attempt, micro_batch_sizes)
    pod = await ctx.kube.get(f"{pods_path}/{name}")
    if pod is not None and not owned_by(pod, ctx.uid):
        await ctx.kube.delete(f"{pods_path}/{name}", pod["metadata"]["uid"])
        raise not_owned(pod)
    if pod is None:
        manifest = render_profiler_pod(job, product, attempt, ctx.config, micro_batch_sizes)
        manifest["metadata"].setdefault("annotations", {})[ANNOTATION_STARTED] = f"{ctx.now:.3f}"
        await ctx.kube.create(pods_path, manifest)
        # The product's series exist (at 0) before its first observation: a histogram that
        # appears with its first sample shows no increase to rate(), so a panel or rule
        # reading it would never see a product profiled once.
        metrics.PROFILING_SECONDS.labels(pool.catalog_name or product)
        return None
    state = pod_state(pod)
    created = _started(pod, ctx.now)
    problem: str | None = None
    if state.phase == PodPhase.SUCCEEDED:
        try:
            result = GpuProfile.model_validate_json(state.message or "")
        except ValidationError as err:
            problem = (f"profiler pod {name} succeeded but its termination message is not a "
                       f"GpuProfile ({err.error_count()} errors): {tail(state.message, 200)}")
        else:
            await _store(ctx, pool, result, micro_batch_sizes)
            finished = ctx.now  # observed now, on the clock `created` is on
            metrics.PROFILING_SECONDS.labels(pool.catalog_name or product).observe(
                max(0.0, finished - created))
            how = "" if result.source == "measured" else f" ({result.source})"  # not twice
            what = f"{len(result.points)} microbatch sizes" if micro_batch_sizes is None \
                else f"micro-batch sizes {size_list(micro_batch_sizes)}"
            ctx.event("Normal", "Profiled", (
                f"{product}: measured {what}{how} in {finished - created:.0f} s"))
            await ctx.kube.delete(f"{pods_path}/{name}")
            return result
    elif state.phase == PodPhase.FAILED:
        problem = (f"profiler pod {name} failed with exit code {state.exit_code}: "
                   f"{tail(state.message)}")
    elif ctx.now - created > ctx.config.profile_timeout_seconds:
        problem = (f"profiler pod {name} did not finish within "
                   f"{ctx.config.profile_timeout_seconds:.0f} s (phase {state.phase})")
    if problem is None:
        return None
    attempts[counted] = attempt + 1
    await save_attempts(ctx, attempts)
    await ctx.kube.delete(f"{pods_path}/{name}")
    if attempt + 1 > ctx.config.profile_retries:
        raise ProfilingFailed(f"profiling {counted} failed {attempt + 1} time(s); last: "
                              f"{problem}")
    ctx.event("Warning", "ProfilerFailed",
              f"{problem}; retrying ({attempt + 2}/{ctx.config.profile_retries + 1})")
    return None


def _started(pod: dict[str, Any], default: float) -> float:
    try:
        return float((pod["metadata"].get("annotations") or {})[ANNOTATION_STARTED])
    except (KeyError, ValueError):  # a pod from before this annotation
        return parse_time(pod["metadata"].get("creationTimestamp")) or default


async def _store(ctx: JobContext, pool: Pool, result: GpuProfile,
                 micro_batch_sizes: list[int] | None = None) -> None:
    assert pool.catalog_name is not None
    name = profile_config_map_name(pool.catalog_name, ctx.job, ctx.config, micro_batch_sizes)
    cm: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ctx.namespace,
                     "labels": {LABEL_PROFILE: "true", LABEL_ROLE: "profile-cache"}},
        "data": {PROFILE_KEY: result.to_compact_json(), "product": pool.catalog_name,
                 "measuredFor": f"{ctx.namespace}/{ctx.name}", "measuredAt": str(int(time.time()))},
    }
    await ctx.kube.create(core_path(ctx.namespace, "configmaps"), cm)


async def delete_profilers(ctx: JobContext) -> int:
    pods = await ctx.kube.list(core_path(ctx.namespace, "pods"),
                               f"{LABEL_JOB}={ctx.name},{LABEL_ROLE}=profiler")
    for pod in pods:
        await ctx.kube.delete(core_path(ctx.namespace, "pods", pod["metadata"]["name"]))
    return len(pods)


__all__ = ["ProfilingFailed", "delete_profilers", "ensure_spec_config_map", "extra_passes",
           "measure_beyond", "profile", "profile_attempts", "profile_one", "save_attempts"]
