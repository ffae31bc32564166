"""What the GPU-subset search minimises: the step time (throughput), or the price per sample
under a throughput floor (`planner.objective: cost`, after Sailor, SOSP'25: on a cloud an
A10G-hour and a T4-hour differ several-fold in price, and the fastest plan is rarely the
cheapest per sample).

A plan's price is what its GPUs cost while it runs: Σ over the GPUs it *uses* of their price
per hour (an idle GPU gets no pod and can be released). Per sample: price per second x step
seconds / B. The floor is `minSamplesPerSecond`, or the throughput that finishes the training
steps left within `deadlineSeconds`, whichever is higher.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from cephalo.api.job import CephaloJobSpec
from cephalo.api.models import TEXT_FAMILIES
from cephalo.api.plan import PlanCost
from cephalo.planner.cost.catalog import gpu_key
from cephalo.planner.search.problem import InfeasibleError, Problem

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Objective:
    """How the subset search ranks choices of GPUs. `price_per_hour`: per class of the full
    problem (None: throughput). `max_step_seconds`: the floor as a step time (inf: none)."""

    price_per_hour: tuple[float, ...] | None = None
    max_step_seconds: float = math.inf

    @property
    def is_cost(self) -> bool:
        return self.price_per_hour is not None

    def hourly(self, counts: list[int]) -> float:
        """Price per hour of `counts[c]` GPUs of each class."""
        assert self.price_per_hour is not None
        return sum(k * p for k, p in zip(counts, self.price_per_hour, strict=True))

    def key(self, counts: list[int], step_seconds: float) -> float:
        """Smaller is better: the step time, or the price per second x step (per B samples)."""
        if self.price_per_hour is None:
            return step_seconds
        return self.hourly(counts) / SECONDS_PER_HOUR * step_seconds

    def step_to_beat(self, counts: list[int], best_key: float) -> float:
        """The step time below which `counts` beats a choice of key `best_key`, within the
        floor (a choice at least this slow is pruned unsolved)."""
        if self.price_per_hour is None:
            return min(best_key, self.max_step_seconds * (1 + 1e-9))
        hourly = self.hourly(counts)
        beat = math.inf if hourly <= 0 else best_key * SECONDS_PER_HOUR / hourly
        return min(beat, self.max_step_seconds * (1 + 1e-9))

    def meets_floor(self, step_seconds: float) -> bool:
        return step_seconds <= self.max_step_seconds * (1 + 1e-12)


THROUGHPUT = Objective()


def class_prices(problem: Problem, prices: Mapping[str, float]) -> tuple[float, ...]:
    """Price per hour of each class's GPUs, matched by catalog name or GFD label; an
    InfeasibleError naming the GPU types without a price."""
    by_key = {gpu_key(name): float(price) for name, price in prices.items()}
    missing = sorted({c.gpu.name for c in problem.classes if c.gpu.name not in by_key})
    if missing:
        raise InfeasibleError(
            f"planner.objective cost needs a price for every GPU type: none for "
            f"{', '.join(missing)}; add them to planner.gpuPricesPerHour (or the operator's "
            f"price list, chart value gpuPricesPerHour)")
    return tuple(by_key[c.gpu.name] for c in problem.classes)


def objective_for(spec: CephaloJobSpec, problem: Problem,
                  remaining_steps: int | None = None) -> Objective:
    """The job's objective on `problem`'s GPUs: throughput, or cost with its floor."""
    planner = spec.planner
    if planner.objective != "cost":
        return THROUGHPUT
    prices = class_prices(problem, planner.gpu_prices_per_hour or {})
    floors = []
    if planner.min_samples_per_second is not None:
        floors.append(planner.min_samples_per_second)
    if planner.deadline_seconds is not None:
        steps = spec.training.steps if remaining_steps is None else remaining_steps
        floors.append(steps * problem.global_batch_size / planner.deadline_seconds)
    floor = max(floors, default=0.0)
    max_step = problem.global_batch_size / floor if floor > 0 else math.inf
    return Objective(price_per_hour=prices, max_step_seconds=max_step)


def floor_message(spec: CephaloJobSpec, objective: Objective, fastest_step: float | None,
                  global_batch_size: int) -> str:
    """Why no choice of GPUs meets the cost objective's floor, with the numbers."""
    need = global_batch_size / objective.max_step_seconds
    what = (f"planner.minSamplesPerSecond / deadlineSeconds ask for {need:.4g} samples/s"
            if spec.planner.deadline_seconds is not None else
            f"planner.minSamplesPerSecond asks for {need:.4g} samples/s")
    best = ("; no choice of the GPUs can reach it" if fastest_step is None else
            f"; the fastest plan gives {global_batch_size / fastest_step:.4g}")
    return f"{what}{best}: lower the floor, extend the deadline or add GPUs"


class FloorNotMetError(InfeasibleError):
    """No choice of GPUs that fits is fast enough for the cost objective's floor."""

    def __init__(self, fastest_step_seconds: float | None) -> None:
        super().__init__("no choice of GPUs meets the throughput floor")
        self.fastest_step_seconds = fastest_step_seconds


def plan_cost(spec: CephaloJobSpec, problem: Problem, counts: list[int], step_seconds: float,
              objective: Objective) -> PlanCost | None:
    """What the plan costs, when every GPU type has a price (the job's prices, whatever the
    objective); None otherwise (plans without prices keep their bytes)."""
    prices = objective.price_per_hour
    if prices is None:
        given = spec.planner.gpu_prices_per_hour
        if not given:
            return None
        try:
            prices = class_prices(problem, given)
        except InfeasibleError:
            return None  # a throughput plan with a partial price list: no price to state
    priced = Objective(price_per_hour=prices)
    full = [len(c.slots) for c in problem.classes]
    tokens = problem.model.tokens_per_sample if problem.model.family in TEXT_FAMILIES else None
    per_sample = priced.key(counts, step_seconds) / problem.global_batch_size
    return PlanCost(
        objective=spec.planner.objective, price_per_hour=priced.hourly(counts),
        price_per_million_samples=per_sample * 1e6,
        price_per_million_tokens=None if tokens is None else per_sample / tokens * 1e6,
        cluster_price_per_hour=priced.hourly(full),
        min_samples_per_second=None if math.isinf(objective.max_step_seconds)
        else problem.global_batch_size / objective.max_step_seconds,
        prices_per_hour={c.gpu.name: p for c, p in zip(problem.classes, prices, strict=True)})
