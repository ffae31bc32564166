"""Re-planning a running job from what it measured (spec.planner.replan; issue 35, item 3;
docs/replanning.md), the I/O half: the pure halves are cephalo.planner.feedback.recalibrate (the
model corrected by the measurement) and cephalo.operator.elastic.decide (whether the new
plan pays for its restart).

A Running job whose current gang has logged `afterSteps` timed steps (status.progress.timing:
rank 0's means of the step and of every rank's compute / waiting) is recalibrated once per
plan: the model the plan was made with, corrected per GPU type for compute and by one factor
for the collectives, is solved again on the GPUs the job holds. When that plan is predicted at
least `minGain` faster than the current one under the same calibration, and the seconds it
saves over the remaining steps exceed the restart cost, it is adopted through the rescale path
(counted in status.elastic.rescales; the old ranks drain to a checkpoint and the new ones resume
from it), with an Event `Replanned` naming the measured and predicted figures.

Never in a loop: a plan is calibrated once; the first calibration after a re-plan checks what
the re-plan delivered (the step measured now against the one measured before it), and a gain
short of `minGain` stops re-planning for the job (status.replan.stopped, Event
`ReplanStopped`): the corrected model did not hold, so nothing more is planned from it. A
noisy or unmodelled cluster (ranks that are not the GPUs profiled) would otherwise re-plan on
every calibration, each promising a gain that never comes. `maxReplans` bounds them all.

A measured throughput under half the prediction that no re-plan fixes is reported: condition
`PredictionOff` True and a Warning Event, with what the calibration found.

Beside live rebalancing (spec.planner.rebalance, docs/rebalancing.md), re-planning decides only
what a rebalance cannot. It calibrates from the split in force (status.rebalance: rank 0's
timing sums restart at each change, so they are that split's), and only once that split has
outlived a rebalancing decision (more timed steps than the rebalancing interval): the compute
it measures belongs to the rebalanced batches, and the gain the rebalance took is in the
running step it compares against, not promised again. A calibrated plan that differs from the
running one only in its split (the same GPUs, microbatch sizes and shards) is kept
(`RebalanceCovers`): live rebalancing moves there without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from cephalo.api import Plan
from cephalo.api.job import CephaloJobSpec
from cephalo.api.replan import PREDICTION_OFF_BELOW
from cephalo.operator import rescale
from cephalo.operator.elastic import RescaleInputs, decide, restart_cost
from cephalo.operator.planning import PlanningFailed, plan_for
from cephalo.operator.render import checkpoint_target, config_hash
from cephalo.operator.status import JobPhase, now_iso
from cephalo.planner.feedback.recalibrate import Calibration, Measured, recalibrate

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")
PREDICTION_OFF = "PredictionOff"  # condition type


async def consider(ctx: JobContext, nodes: list[dict[str, Any]],
                   plan: Plan) -> rescale.Growth | None:
    """A Growth when the job should re-plan now; else None (a calibration recorded when one
    was made)."""
    spec = ctx.job.spec
    replan = spec.planner.replan
    if not replan.enabled or ctx.status.get("phase") != JobPhase.RUNNING or \
            rescale.rescaling(ctx):
        return None
    progress = ctx.status.get("progress") or {}
    timing = progress.get("timing") or {}
    step = progress.get("step")
    compute, wait = timing.get("computeSeconds"), timing.get("waitSeconds")
    if step is None or int(timing.get("steps") or 0) < _timed_steps_needed(spec, plan) or \
            not timing.get("stepSeconds") or (compute is not None and
                                              len(compute) != plan.world_size):
        return None  # not enough timed steps yet (of the split in force), or another gang's
    plan_hash = config_hash(ctx.job, plan)
    state: dict[str, Any] = dict(ctx.decided("replan") or {})
    if (state.get("lastCalibration") or {}).get("planHash") == plan_hash:
        return None  # once per plan
    split = split_in_force(ctx.status.get("rebalance"), plan)
    measured = Measured(float(timing["stepSeconds"]), compute, wait, split)
    entry: dict[str, Any] = {"time": now_iso(ctx.now), "planHash": plan_hash,
                             "step": int(step), "measuredStepSeconds": measured.step_seconds,
                             "predictedStepSeconds": plan.predicted_step_seconds,
                             "currentGpus": plan.world_size}
    if split is not None:
        entry["batchSizes"] = split
    gain = delivered_gain(state, measured.step_seconds)
    if gain is not None:
        entry["measuredGain"] = round(gain, 4)
    stop = replan_stop(state, gain, replan.min_gain, replan.max_replans)
    if stop is not None:
        code, why = stop
        if code == "ReplanDidNotPay" and not state.get("stopped"):
            state["stopped"] = why
            ctx.event("Warning", "ReplanStopped", why)
            log.info("%s/%s: re-planning stops: %s", ctx.namespace, ctx.name, why)
        _finish(ctx, state, plan, measured, entry, "Keep", code, why)
        return None
    held = await rescale.held_inputs(ctx, nodes, rescale.plan_pools(plan), "re-plan")
    if held is None:
        return None
    try:  # pure numpy, bounded by one plan's size; off the event loop all the same
        cal = await asyncio.to_thread(recalibrate, spec, held.cluster, held.profiles, plan,
                                      measured, known_compute_scale(state))
    except ValueError as err:
        _finish(ctx, state, plan, measured, entry, "Keep", "CalibrationFailed",
                f"the measurement could not be used: {err}")
        return None
    entry.update(_figures(cal))
    if not cal.explained:
        _finish(ctx, state, plan, measured, entry, "Keep", "Unexplained",
                f"the calibrated model predicts {cal.calibrated_step_seconds:.3g} s for the "
                f"running plan, not the measured {measured.step_seconds:.3g} s ({cal.describe()})"
                f": no plan from it can be trusted", cal)
        return None
    try:
        candidate = await plan_for(ctx.config, spec, cal.cluster, cal.profiles)
    except PlanningFailed as err:
        _finish(ctx, state, plan, measured, entry, "Keep", "PlanningFailed",
                f"no plan from the calibrated model: {err}", cal)
        return None
    entry.update(candidateStepSeconds=candidate.predicted_step_seconds,
                 candidateGpus=candidate.world_size)
    if spec.planner.rebalance.enabled and only_split_differs(plan, candidate) and \
            [r.batch_size for r in candidate.ranks] != (split or [r.batch_size
                                                               for r in plan.ranks]):
        _finish(ctx, state, plan, measured, entry, "Keep", "RebalanceCovers",
                f"calibrated on the running split ({cal.describe()}): the plan it gives "
                f"differs only in its split of the global batch "
                f"{[r.batch_size for r in candidate.ranks]}, which live rebalancing moves to "
                "without a restart", cal)
        return None
    elastic = ctx.decided("elastic") or {}
    cost, cost_measured = restart_cost(elastic.get("restartSeconds"),
                                       replan.restart_cost_seconds)
    batch = spec.global_batch_size
    remaining = max(0, spec.training.steps - int(step))
    decision = decide(RescaleInputs(
        now=ctx.now, current_gpus=plan.world_size, candidate_gpus=candidate.world_size,
        current_samples_per_second=batch / cal.calibrated_step_seconds,
        candidate_samples_per_second=candidate.predicted_samples_per_second or 0.0,
        measured_samples_per_second=batch / measured.step_seconds,
        global_batch_size=batch, remaining_steps=remaining, restart_cost_seconds=cost,
        restart_cost_measured=cost_measured, min_gain=replan.min_gain, cooldown_seconds=0.0,
        last_rescale_at=None))
    storage = checkpoint_target(ctx.job, candidate.world_size)
    if decision.verdict == "Rescale" and (storage.refusal or not storage.durable):
        _finish(ctx, state, plan, measured, entry, "Keep", "NotDurable",
                f"{decision.reason}, but a re-plan restarts from the last checkpoint and "
                f"{storage.message}", cal)
        return None
    if decision.verdict != "Rescale":
        _finish(ctx, state, plan, measured, entry, "Keep", decision.code,
                f"calibrated on the running plan ({cal.describe()}): {decision.reason}", cal)
        return None
    reason = (f"measured {measured.step_seconds:.3g} s per step, predicted "
              f"{plan.predicted_step_seconds or 0.0:.3g} s ({cal.describe()}); re-planned "
              f"on the same GPUs: {decision.reason}")
    _finish(ctx, state, plan, measured, entry, "Replan", "Replanned", reason, cal)
    rescale.begin(ctx, plan, int(step))
    ctx.event("Normal", "Replanned", reason + "; the ranks drain at the next step boundary "
              "and resume from its checkpoint")
    log.info("%s/%s: re-planning: %s", ctx.namespace, ctx.name, reason)
    used = {g.pool or g.product for g in held.cluster.groups}
    return rescale.Growth(candidate, [p for p in held.pools if p.product in used], storage)


def _timed_steps_needed(spec: CephaloJobSpec, plan: Plan) -> int:
    """Timed steps of one split before a calibration: `afterSteps`, and with live
    rebalancing more than its interval (the timing restarts at each change, so the split
    then outlived a decision: it is the one rebalancing settled on). A gang with fewer than
    two ranks that take samples has no split to move: it waits `afterSteps` only (a
    one-GPU job of 12 steps otherwise never calibrated under the default interval of 10)."""
    needed = int(spec.planner.replan.after_steps)
    rebalance = spec.planner.rebalance
    movable = sum(1 for r in plan.ranks if r.batch_size > 0) >= 2
    return max(needed, rebalance.interval_steps + 1) if rebalance.enabled and movable \
        else needed


def split_in_force(rebalance: dict[str, Any] | None, plan: Plan) -> list[int] | None:
    """status.rebalance's split when it is one of `plan`'s global batch over its ranks and
    not the plan's own; None otherwise (the plan's, or another gang's figures)."""
    split = (rebalance or {}).get("batchSizes")
    planned = [r.batch_size for r in plan.ranks]
    if not isinstance(split, list) or len(split) != len(planned) or \
            sum(split) != sum(planned) or split == planned:
        return None
    return [int(b) for b in split]


def only_split_differs(plan: Plan, candidate: Plan) -> bool:
    """The candidate runs the same ranks on the same GPUs with the same microbatch sizes and
    shards, and differs at most in how many samples each takes: a live rebalance's move."""
    def layout(p: Plan) -> list[tuple[Any, ...]]:
        return [(r.gpu, r.pool, r.gpu_index, r.micro_batch_size, round(r.shard_ratio, 9))
                for r in p.ranks]
    return candidate.world_size == plan.world_size and layout(candidate) == layout(plan)


def known_compute_scale(state: dict[str, Any]) -> dict[str, float]:
    """What this job's last calibration found per GPU type (status.replan.lastCalibration.
    computeScale: itself carried forward, so every type the job ever measured), for the
    types the next plan does not compute on."""
    found = (state.get("lastCalibration") or {}).get("computeScale") or {}
    return {str(gpu): float(s) for gpu, s in found.items() if isinstance(s, int | float)}


def delivered_gain(state: dict[str, Any], measured_step_seconds: float) -> float | None:
    """What the last re-plan delivered, when this is the first calibration since it (the
    last one re-planned): throughput now over throughput before, minus 1. Steps carry the
    same global batch before and after, so step times compare directly."""
    last = state.get("lastCalibration") or {}
    before = last.get("measuredStepSeconds")
    if last.get("verdict") != "Replan" or not before or measured_step_seconds <= 0:
        return None
    return float(before) / measured_step_seconds - 1.0


def replan_stop(state: dict[str, Any], gain: float | None, min_gain: float,
                max_replans: int) -> tuple[str, str] | None:
    """(reason code, why) when this job must not re-plan again; None when it may."""
    if state.get("stopped"):
        return "ReplanStopped", str(state["stopped"])
    if gain is not None and gain < min_gain:
        last = state.get("lastCalibration") or {}
        calibrated, candidate = last.get("calibratedStepSeconds"), last.get("candidateStepSeconds")
        promised = (f"predicted {calibrated / candidate - 1:+.0%}, "
                    if calibrated and candidate else "")
        return "ReplanDidNotPay", (
            f"the last re-plan was {promised}measured {gain:+.0%} ("
            f"{last.get('measuredStepSeconds', 0.0):.3g} s per step before it), short of "
            f"minGain {min_gain:.0%}: the corrected model does not hold on these GPUs, so "
            "this job re-plans no more from it")
    replans = int(state.get("replans") or 0)
    if replans >= max_replans:
        return "ReplanLimit", (f"{replans} re-plan(s) made, spec.planner.replan.maxReplans is "
                               f"{max_replans}")
    return None


def _figures(cal: Calibration) -> dict[str, Any]:
    return {"calibratedStepSeconds": cal.calibrated_step_seconds,
            "computeScale": {k: round(v, 4) for k, v in sorted(cal.compute_scale.items())},
            "collectiveScale": round(cal.collective_scale, 4),
            "networkBandwidthGbps": round(cal.bandwidth_bytes_per_second * 8 / 1e9, 6),
            "networkLatencyMicroseconds": round(cal.latency_seconds * 1e6, 3),
            "explained": cal.explained}


def _finish(ctx: JobContext, state: dict[str, Any], plan: Plan, measured: Measured,
            entry: dict[str, Any], verdict: str, code: str, reason: str,
            cal: Calibration | None = None) -> None:
    """Record the calibration in status.replan, and report a prediction far off that this
    calibration does not fix (condition PredictionOff, a Warning Event) — or that it is not."""
    state["lastCalibration"] = {**entry, "verdict": verdict, "reasonCode": code,
                                "reason": reason}
    if verdict == "Replan":
        state["replans"] = int(state.get("replans") or 0) + 1
        state["lastReplan"] = state["lastCalibration"]
    ctx.record(replan=state)
    predicted = plan.predicted_step_seconds
    if not predicted:
        return  # a plan without a prediction (written by hand) cannot be off
    ratio = predicted / measured.step_seconds  # measured throughput / predicted
    if verdict == "Replan" or ratio >= PREDICTION_OFF_BELOW:
        off = ("False", "Replanned" if verdict == "Replan" else "WithinBounds",
               f"measured {ratio:.2f}x the predicted throughput" +
               ("; re-planned from the calibration" if verdict == "Replan" else ""))
    else:
        found = f" ({cal.describe()})" if cal is not None else ""
        message = (f"measured {measured.step_seconds:.3g} s per step, {ratio:.2f}x the "
                   f"throughput the plan predicted ({predicted:.3g} s){found}; no re-plan on "
                   f"the GPUs it holds fixes it: {reason}")
        off = ("True", code, message)
        ctx.event("Warning", PREDICTION_OFF, message)
    ctx.condition(PREDICTION_OFF, *off)


__all__ = ["PREDICTION_OFF", "consider", "delivered_gain", "known_compute_scale",
           "only_split_differs", "replan_stop", "split_in_force"]
