"""Which micro-batch sizes a plan assigns that its profiles never measured (pure).

The profiler measures a few small sizes (spec.planner.profileMicroBatchSizes, 1-8 by
default); beyond the largest the cost model extrapolates time and memory linearly
(costmodel.GpuCostModel). The time extrapolation is the paper's method; the memory one can
understate what a large microbatch holds and put a rank out of memory on its first step.
So before a plan is used, `cephalo run` and the operator measure every size it assigns
above its GPU's profiled range (one short profiler pass per product), merge the points
(cephalo.api.profile.merge_points) and plan again, at most MAX_MEASURE_ROUNDS times: a
measurement can move the plan to a size larger still, and a chase without end would never
start the job. What is left extrapolated after that is said in the plan's notes and marked
on its ranks (RankPlan.extrapolated).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cephalo.api.plan import Plan
from cephalo.api.profile import GpuProfile, merge_points, profiled_sizes

# Rounds of measure-then-plan-again before a plan is used with what is measured.
MAX_MEASURE_ROUNDS = 2
# The profiler's own bound on a size (PlannerSpec.profile_micro_batch_sizes).
LARGEST_PROFILABLE_SIZE = 4096


def unmeasured_micro_batch_sizes(plan: Plan,
                                 profiles: Mapping[str, GpuProfile]) -> dict[str, list[int]]:
    """{GPU product: [sizes]} the plan assigns above the largest size of that product's
    measured profile (a rank's `gpu` names its profile). Catalog estimates (no profile, or
    source `estimated`) are left out: nothing measured them at any size, and the plan
    already marks them estimated; so are sizes the profiler cannot take."""
    wanted: dict[str, set[int]] = {}
    for rank in plan.ranks:
        profile = profiles.get(rank.gpu)
        if profile is None or profile.source == "estimated" or rank.batch_size == 0:
            continue
        if max(profiled_sizes(profile)) < rank.micro_batch_size <= LARGEST_PROFILABLE_SIZE:
            wanted.setdefault(rank.gpu, set()).add(rank.micro_batch_size)
    return {product: sorted(sizes) for product, sizes in sorted(wanted.items())}


def size_list(sizes: list[int]) -> str:
    """'16, 32'."""
    return ", ".join(map(str, sizes))


def profiled_range(profile: GpuProfile) -> str:
    """'1-8' (or '4' for one size): the sizes a profile covers, as said to a user."""
    sizes = profiled_sizes(profile)
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"


def describe_unmeasured(wanted: Mapping[str, list[int]],
                        profiles: Mapping[str, GpuProfile]) -> str:
    """'micro-batch sizes 16, 32 of A10G (beyond the profiled 1-8)', one clause a product."""
    parts = []
    for product, sizes in wanted.items():
        noun = "size" if len(sizes) == 1 else "sizes"
        parts.append(f"micro-batch {noun} {size_list(sizes)} of {product} (beyond the "
                     f"profiled {profiled_range(profiles[product])})")
    return "; ".join(parts)


def with_unmeasured_note(plan: Plan, wanted: Mapping[str, list[int]],
                         profiles: Mapping[str, GpuProfile]) -> Plan:
    """The plan with a note that it is used with the extrapolated sizes `wanted` (after
    MAX_MEASURE_ROUNDS rounds of measuring moved it each time); unchanged when none."""
    if not wanted:
        return plan
    note = (f"planned with {describe_unmeasured(wanted, profiles)} extrapolated: measuring "
            f"moved the plan {MAX_MEASURE_ROUNDS} times, so it is used with what is measured "
            "(its time and memory there are linear extrapolations; add the sizes to "
            "spec.planner.profileMicroBatchSizes to measure them)")
    return plan.model_copy(update={"notes": [*plan.notes, note]})


def merge_measured(profiles: Mapping[str, GpuProfile],
                   extra: Mapping[str, GpuProfile]) -> dict[str, GpuProfile]:
    """`profiles` with each product's extra points (`extra`, by product) merged in."""
    return {product: merge_points(profile, extra[product]) if product in extra else profile
            for product, profile in profiles.items()}


@dataclass(frozen=True)
class MeasuredPlan:
    plan: Plan
    profiles: dict[str, GpuProfile]  # with every point measured for it
    rounds: int  # extra profiler passes made (0: the plan used only profiled sizes)
    # Sizes a pass was wanted for but `measure` had none of (a preview reading the
    # operator's cache: the operator measures them before it uses the plan).
    not_measured: dict[str, list[int]] = field(default_factory=dict)


def plan_on_measured_sizes(
        solve: Callable[[Mapping[str, GpuProfile]], Plan],
        measure: Callable[[Mapping[str, list[int]]], Mapping[str, GpuProfile] | None],
        profiles: Mapping[str, GpuProfile]) -> MeasuredPlan:
    """Plan, measure the sizes the plan assigns beyond the profiled ones, plan again, until
    the plan uses only measured sizes or MAX_MEASURE_ROUNDS passes were made (then the plan
    says what is left extrapolated). `solve(profiles)` plans; `measure({product: sizes})`
    runs the profiler for just those sizes and returns {product: profile with those
    points} (the caller's I/O: `cephalo run`'s profiler processes), or None when it cannot
    (`cephalo plan --cluster`: a pass the operator has not cached yet): the plan so far
    is returned with the sizes in `not_measured`."""
    current = dict(profiles)
    plan = solve(current)
    for rounds in range(MAX_MEASURE_ROUNDS):
        wanted = unmeasured_micro_batch_sizes(plan, current)
        if not wanted:
            return MeasuredPlan(plan, current, rounds)
        measured = measure(wanted)
        if measured is None:
            return MeasuredPlan(plan, current, rounds, wanted)
        current = merge_measured(current, measured)
        plan = solve(current)
    left = unmeasured_micro_batch_sizes(plan, current)
    return MeasuredPlan(with_unmeasured_note(plan, left, current), current,
                        MAX_MEASURE_ROUNDS)
