"""Micro-batch sizes a plan assigns beyond what its profiles measured (issue 46 item 3):
named per product, marked on the plan, measured and planned again (bounded)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from cephalo.api import ClusterSpec, GpuGroup, Plan
from cephalo.api.job import CephaloJobSpec
from cephalo.api.plan import RankPlan
from cephalo.api.profile import GpuProfile, ProfileMergeError, merge_points, profiled_sizes
from cephalo.planner import estimate_profile, lookup_gpu, solve
from cephalo.planner.feedback.measured_sizes import (
    MAX_MEASURE_ROUNDS,
    describe_unmeasured,
    plan_on_measured_sizes,
    unmeasured_micro_batch_sizes,
)
from cephalo.planner.outputs.report import EXTRAPOLATED_LEGEND, format_plan

A10G = lookup_gpu("A10G")


def _spec(batch: int = 64, sizes: tuple[int, ...] = (1, 2)) -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-small"}, "globalBatchSize": batch,
        "planner": {"profileMicroBatchSizes": list(sizes)}})


def _measured(spec: CephaloJobSpec, sizes: list[int]) -> GpuProfile:
    """A profile of the A10G at `sizes` as the profiler would hand it over (the catalog's
    figures, but marked measured: what is tested is which sizes it holds)."""
    return estimate_profile(A10G, spec.model.resolve(), "fp32", sizes).model_copy(
        update={"source": "measured"})


CLUSTER = ClusterSpec(groups=[GpuGroup(product="NVIDIA-A10G", count=2)])


def test_a_plan_beyond_the_profiled_sizes_names_them_and_marks_its_ranks() -> None:
    spec = _spec()
    profiles = {A10G.name: _measured(spec, [1, 2])}
    plan = solve(spec, CLUSTER, profiles)
    beyond = [r for r in plan.ranks if r.batch_size and r.micro_batch_size > 2]
    assert beyond, plan.ranks  # the test's premise: the planner picks a size above 2
    assert all(r.extrapolated for r in beyond)
    wanted = unmeasured_micro_batch_sizes(plan, profiles)
    assert wanted == {A10G.name: sorted({r.micro_batch_size for r in beyond})}
    sizes = ", ".join(map(str, wanted[A10G.name]))
    assert describe_unmeasured(wanted, profiles) == \
        f"micro-batch size{'s' if len(beyond) > 1 else ''} {sizes} of A10G (beyond the " \
        "profiled 1-2)"
    printed = format_plan(plan, "gpt-small")
    assert f"~{beyond[0].micro_batch_size}x{beyond[0].num_micro_batches}" in printed
    assert f"note: {EXTRAPOLATED_LEGEND}" in printed
    assert plan.to_json().count('"extrapolated": true') == len(beyond)


def test_sizes_within_the_profile_are_neither_marked_nor_measured_again() -> None:
    spec = _spec()
    profiles = {A10G.name: _measured(spec, [1, 2, 4, 8, 16, 32, 64])}
    plan = solve(spec, CLUSTER, profiles)
    assert unmeasured_micro_batch_sizes(plan, profiles) == {}
    assert "extrapolated" not in plan.to_json()  # the bytes of plans before the field
    assert EXTRAPOLATED_LEGEND not in format_plan(plan, "gpt-small")


def test_a_size_between_two_measured_sizes_is_interpolated_not_measured() -> None:
    """Regression (a fresh-clone CI run): after size 6 was measured beyond the profiled
    1-2, the plan took 3 (that machine's measured 6 made two microbatches cheaper); 3 lies
    between measured points, where the cost model interpolates, so nothing is measured
    again and nothing is marked extrapolated."""
    spec = _spec(batch=6)
    profiles = {A10G.name: _measured(spec, [1, 2, 6])}
    plan = Plan(global_batch_size=6, world_size=1,
                ranks=[_rank(A10G.name, 3, batch=6).model_copy(
                    update={"num_micro_batches": 2})])
    assert unmeasured_micro_batch_sizes(plan, profiles) == {}


def _rank(gpu: str, micro: int, batch: int | None = None) -> RankPlan:
    batch = micro if batch is None else batch
    return RankPlan(rank=0, gpu=gpu, batch_size=batch, micro_batch_size=micro,
                    num_micro_batches=1 if batch else 0, shard_ratio=1.0)


def test_catalog_estimates_state_only_ranks_and_unprofilable_sizes_are_not_measured() -> None:
    spec = _spec()
    estimated = estimate_profile(A10G, spec.model.resolve(), "fp32", [1, 2])
    one = {A10G.name: _measured(spec, [1])}
    state_only = Plan(global_batch_size=4, world_size=2, ranks=[
        _rank(A10G.name, 0, batch=0).model_copy(update={"shard_ratio": 0.5}),
        _rank("cpu", 4).model_copy(update={"rank": 1, "shard_ratio": 0.5})])
    for plan, profiles in [(_one_rank(16), {A10G.name: estimated}),  # the catalog's
                           (_one_rank(16), {}),  # no profile at all: estimated too
                           (state_only, one),
                           (_one_rank(5000), one)]:  # above the profiler's bound
        assert unmeasured_micro_batch_sizes(plan, profiles) == {}, (plan, profiles)


def _one_rank(micro: int) -> Plan:
    return Plan(global_batch_size=micro, world_size=1, ranks=[_rank(A10G.name, micro)])


def test_merge_points_adds_new_sizes_and_takes_the_newer_of_one_size() -> None:
    spec = _spec()
    base = _measured(spec, [1, 2]).model_copy(update={"optimizer_seconds_fixed": 0.5})
    extra = _measured(spec, [2, 16]).model_copy(update={"optimizer_seconds_fixed": 9.0})
    extra = extra.model_copy(update={"points": [
        p.model_copy(update={"compute_memory_bytes": 7}) for p in extra.points]})
    merged = merge_points(base, extra)
    assert profiled_sizes(merged) == [1, 2, 16]
    assert [p.compute_memory_bytes for p in merged.points][1:] == [7, 7]
    assert merged.points[0] == base.points[0]
    assert merged.optimizer_seconds_fixed == 0.5  # the base pass's scalars
    other = extra.model_copy(update={"product": "T4"})
    with pytest.raises(ProfileMergeError, match="product 'T4'"):
        merge_points(base, other)


def test_a_plan_beyond_the_profile_is_measured_once_and_then_uses_measured_sizes() -> None:
    spec = _spec()
    calls: list[dict[str, list[int]]] = []

    def measure(wanted: Mapping[str, list[int]]) -> dict[str, GpuProfile]:
        calls.append(dict(wanted))
        return {product: _measured(spec, sizes) for product, sizes in wanted.items()}

    result = plan_on_measured_sizes(lambda p: solve(spec, CLUSTER, p), measure,
                                    {A10G.name: _measured(spec, [1, 2])})
    assert len(calls) == 1 and result.rounds == 1
    assert unmeasured_micro_batch_sizes(result.plan, result.profiles) == {}
    assert not any(r.extrapolated for r in result.plan.ranks)
    assert set(calls[0][A10G.name]) <= set(profiled_sizes(result.profiles[A10G.name]))


def test_a_measured_memory_above_the_extrapolation_moves_the_plan() -> None:
    """The reason to measure: on a real GPU a large microbatch can hold more than the
    linear extrapolation says. Measured so, the size does not fit and the plan changes."""
    spec = _spec()
    first = solve(spec, CLUSTER, {A10G.name: _measured(spec, [1, 2])})

    def measure(wanted: Mapping[str, list[int]]) -> dict[str, GpuProfile]:
        out = {}
        for product, sizes in wanted.items():
            taken = _measured(spec, sizes)
            out[product] = taken.model_copy(update={"points": [p.model_copy(update={
                "compute_memory_bytes": A10G.memory_bytes}) for p in taken.points]})
        return out

    result = plan_on_measured_sizes(lambda p: solve(spec, CLUSTER, p), measure,
                                    {A10G.name: _measured(spec, [1, 2])})
    before = {r.micro_batch_size for r in first.ranks if r.batch_size}
    after = {r.micro_batch_size for r in result.plan.ranks if r.batch_size}
    assert before.isdisjoint(after), (before, after)  # no rank keeps a size that does not fit
    assert result.rounds >= 1


def test_a_plan_that_keeps_moving_is_used_after_the_last_round_and_says_so() -> None:
    spec = _spec()
    profiles = {A10G.name: _measured(spec, [1, 2])}
    measured: list[Mapping[str, list[int]]] = []

    def solve_growing(current: Mapping[str, GpuProfile]) -> Plan:
        # Each plan picks a size twice the largest measured: never settles.
        micro = 2 * max(profiled_sizes(current[A10G.name]))
        return Plan(global_batch_size=micro, world_size=1,
                    ranks=[_rank(A10G.name, micro)])

    def measure(wanted: Mapping[str, list[int]]) -> dict[str, GpuProfile]:
        measured.append(wanted)
        return {p: _measured(spec, s) for p, s in wanted.items()}

    result = plan_on_measured_sizes(solve_growing, measure, profiles)
    assert [w[A10G.name] for w in measured] == [[4], [8]]
    assert result.rounds == MAX_MEASURE_ROUNDS == 2
    assert result.plan.ranks[0].micro_batch_size == 16
    (note,) = result.plan.notes
    assert note.startswith("planned with micro-batch size 16 of A10G (beyond the profiled "
                           "1-8) extrapolated: measuring moved the plan 2 times")


def test_a_pass_that_cannot_be_measured_leaves_the_plan_so_far_and_names_its_sizes() -> None:
    """`cephalo plan --cluster` reads each pass from the operator's cache: one not cached
    yet stops there, with the sizes the operator measures before it uses the plan."""
    spec = _spec()
    profiles = {A10G.name: _measured(spec, [1, 2])}
    first = solve(spec, CLUSTER, profiles)
    asked: list[Mapping[str, list[int]]] = []

    def nothing_cached(wanted: Mapping[str, list[int]]) -> None:
        asked.append(wanted)
        return None

    result = plan_on_measured_sizes(lambda p: solve(spec, CLUSTER, p), nothing_cached, profiles)
    assert result.plan == first and result.rounds == 0 and result.profiles == profiles
    assert asked == [unmeasured_micro_batch_sizes(first, profiles)]
    assert result.not_measured == asked[0] and result.not_measured
    assert not result.plan.notes or "measuring moved" not in " ".join(result.plan.notes)
