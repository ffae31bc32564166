"""What the solver decides between its candidates beyond the objective's order, and what
the plan then says about it: every GPU kept when fewer gain less than the margin
(`planner.minGainToIdleGpus`), the closer of two modes that miss a throughput floor, and
the idle GPUs' reason under the cost objective. Split from `cephalo.planner.search.solver`."""

from __future__ import annotations

from cephalo.api.plan import Plan
from cephalo.planner.search.pricing import FloorNotMetError, Objective
from cephalo.planner.search.problem import Problem
from cephalo.planner.search.subset import Choice


def every_gpu(modes: list[tuple[Choice, int, bool]]) -> tuple[Choice, int, bool] | None:
    """The whole cluster's choice in its fastest mode (a tie to the later mode, as between
    the modes' best choices), with that mode's search counts; None where it does not fit."""
    found: tuple[Choice, int, bool] | None = None
    for choice, solved, exhaustive in modes:
        whole = choice.full
        if whole is not None and (found is None or
                                  whole.step_seconds <= found[0].step_seconds * (1 + 1e-12)):
            found = (whole, solved, exhaustive)
    return found


def note_min_gain(plan: Plan, choice: Choice, fastest: Choice, min_gain: float,
                   kept_every_gpu: bool) -> None:
    """Say both step times when the margin decided (planner.minGainToIdleGpus): every GPU
    kept although fewer are predicted faster. Plans the margin did not touch keep their
    bytes."""
    if not kept_every_gpu or fastest.step_seconds >= choice.step_seconds:
        return
    gain = choice.step_seconds / fastest.step_seconds - 1
    used, total = sum(fastest.counts), sum(choice.counts)
    plan.notes.append(
        f"all {total} GPUs used: {used} of them are predicted {fastest.step_seconds:.4g} s per "
        f"step against {choice.step_seconds:.4g} s, {gain:.1%} more throughput, within "
        f"planner.minGainToIdleGpus ({min_gain:.0%}), which is about the cost model's error")
    plan.search["fastest_gpu_subset_step_seconds"] = fastest.step_seconds
    plan.search["min_gain_to_idle_gpus"] = min_gain


def faster_miss(seen: FloorNotMetError | None, err: FloorNotMetError) -> FloorNotMetError:
    """Of two modes that miss the floor, the one that came closer (the error quotes it)."""
    if seen is None or seen.fastest_step_seconds is None:
        return err
    if err.fastest_step_seconds is not None and \
            err.fastest_step_seconds < seen.fastest_step_seconds:
        return err
    return seen


def cost_idle_reason(plan: Plan, objective: Objective, problem: Problem,
                      choice: Choice) -> None:
    """The idle GPUs' reason under the cost objective: both prices per sample."""
    assert choice.full_step_seconds is not None and plan.cost is not None
    full = [len(c.slots) for c in problem.classes]
    every = objective.key(full, choice.full_step_seconds) / problem.global_batch_size * 1e6
    reason = (f"fewer GPUs are cheaper per sample: {choice.problem.world_size} of the "
              f"{problem.world_size} cost ${plan.cost.price_per_hour:.4g}/h and "
              f"${plan.cost.price_per_million_samples:.4g} per million samples at "
              f"{plan.predicted_step_seconds:.4g} s per step; all of them "
              f"${objective.hourly(full):.4g}/h and ${every:.4g} per million samples at "
              f"{choice.full_step_seconds:.4g} s (planner.objective: cost)")
    for idle in plan.idle_gpus:
        idle.reason = reason
