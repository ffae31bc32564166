"""Per-unit sharding: which units the planner shards evenly, checked against brute force
over every subset of units; the cost model charges the uneven overhead only to skewed
units; the plan carries the per-unit ratios (omitted when uniform) and `cephalo plan`
shows them."""

from __future__ import annotations

import contextlib
import itertools
import json
import random

import numpy as np
import pytest

from cephalo.api.plan import parse_plan
from cephalo.api.sharding import shard_bounds
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.cost.comm_model import CommModel, UnitComm
from cephalo.planner.outputs.report import format_plan
from cephalo.planner.search.evaluate import score, score_best
from cephalo.planner.search.offload import plan_fused_tail_blocks as fused_tail_blocks
from cephalo.planner.search.problem import build_problem
from cephalo.planner.search.solver import solve_fixed
from cephalo.planner.search.unit_search import search_even_sets
from cephalo.planner.search.unit_shards import (
    EvenUnits,
    even_unit_options,
    fits,
    max_even_units,
    mixed_unit_comm,
    unit_shard_ratios,
)

from .planner_instances import job_spec, random_instance

# Seeds of planner_instances.random_instance(seed, 3, 8) whose optimum mixes even and
# skewed units (found by the solver; the oracle test checks them against brute force).
MIXED_SEEDS = [5, 21, 45, 65, 68]


@pytest.mark.parametrize("seed", range(200))
def test_most_even_units_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([1, 2, 3, 5, 8]) * rng.randint(1, 4) for _ in range(rng.randint(0, 9))]
    capacity = rng.uniform(0, sum(sizes) + 1)
    chosen = max_even_units(sizes, capacity)
    assert sum(sizes[i] for i in chosen) <= capacity
    best = max((k for k in range(len(sizes) + 1)
                for subset in itertools.combinations(range(len(sizes)), k)
                if sum(sizes[i] for i in subset) <= capacity), default=0)
    assert len(chosen) == best


def _subsets(layers: int):
    """Every subset of the L + 2 units, as the cost model and the memory see it."""
    for k in range(layers + 3):
        for s in itertools.combinations(range(layers + 2), k):
            yield s, EvenUnits(0 in s, layers + 1 in s, sum(1 for u in s if 1 <= u <= layers))


def test_even_unit_options_cover_every_subset() -> None:
    for layers in range(5):
        options = set(even_unit_options(layers))
        assert options == {e for _, e in _subsets(layers)}
        assert len(options) == 4 * (layers + 1)


def _random_assignment(rng: random.Random, n: int, batch: int, state_only: bool):
    cuts = sorted(rng.randint(0, batch) for _ in range(n - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, batch], strict=True)]
    if not state_only and 0 in sizes:
        return None
    micro, ell = [], []
    for b in sizes:
        m = rng.choice([d for d in range(1, b + 1) if b % d == 0]) if b else 0
        micro.append(m)
        ell.append(b // m if m else 0)
    return micro, ell


def test_score_best_is_the_best_subset_of_even_units() -> None:
    """For a fixed assignment, score_best's partition is the fastest over all 2^(L+2) choices
    of even units; the memory test `fits` agrees with `score`'s feasibility on each. Some of
    the instances' best partitions mix even and skewed units."""
    mixed = [seed for seed in range(150) if _check_score_best(seed)]
    assert len(mixed) >= 3


def _check_score_best(seed: int) -> bool:
    spec, cluster, profiles = random_instance(seed, max_gpus=4, max_batch=10)
    problem = build_problem(spec, cluster, profiles)
    rng = random.Random(seed)
    got = _random_assignment(rng, problem.world_size, problem.global_batch_size,
                             problem.allow_state_only)
    if got is None:
        return False
    micro, ell = got
    layers = problem.model.num_layers
    times = []
    for subset, even in _subsets(layers):
        ev = score(problem, micro, ell, even_units=even)
        rooms = [problem.rank_budget(r) - ev.rank_compute_bytes[r]
                 for r in range(problem.world_size)]
        if problem.world_size > 1 and len(subset) not in (0, layers + 2):
            assert ev.feasible == fits(problem.model, problem.precision, even, rooms,
                                       problem.state_bytes), subset
        if ev.feasible:
            times.append(ev.step_seconds)
    best = score_best(problem, micro, ell)
    assert best.feasible == bool(times)
    if times:
        assert best.step_seconds == pytest.approx(min(times), rel=1e-12)
    return best.even_units is not None


@pytest.mark.parametrize("seed", MIXED_SEEDS)
def test_branch_and_bound_matches_every_even_set(seed: int) -> None:
    spec, cluster, profiles = random_instance(seed, max_gpus=3, max_batch=8)
    problem = build_problem(spec, cluster, profiles)
    sol = solve_fixed(problem)
    even = sol.even_units
    assert 0 < even.count() < problem.model.num_layers + 2  # a mixed plan
    # Mixed beats both of the old partitions (all even, all skewed).
    step = score(problem, sol.micro, sol.ell, even_units=even, kept=sol.kept).step_seconds
    for flat in (True, False):
        try:
            layers = problem.model.num_layers
            other = solve_fixed_with(problem, EvenUnits.all(layers) if flat else EvenUnits.none())
        except InfeasibleError:
            continue
        assert step <= other * (1 + 1e-12)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    if fused_tail_blocks(plan) == problem.model.num_layers:
        # Every block in the fused tail, a mode of its own, was faster still.
        assert plan.predicted_step_seconds < step
        return
    assert plan.unit_shard_ratios  # the plan says which units differ
    assert plan.predicted_step_seconds == pytest.approx(step, rel=1e-12)


def solve_fixed_with(problem, even: EvenUnits) -> float:
    """The least step time with exactly `even`'s units sharded evenly."""
    from cephalo.planner.search.bottleneck import min_bottleneck
    from cephalo.planner.search.unit_search import even_set_tables

    tables, room = even_set_tables(problem, even)
    found = min_bottleneck(tables, problem.global_batch_size, room)
    if found is None:
        raise InfeasibleError("no split")
    return found.threshold_seconds


def test_search_on_a_paper_model_uses_few_searches() -> None:
    """GPT-6.7B on 8 GPUs with tight memory: mixed units, found with far fewer searches
    than the 4 (L + 1) even sets, and equal to the exhaustive optimum."""
    from cephalo.api import ClusterSpec, GpuGroup

    cluster = ClusterSpec(groups=[
        GpuGroup(product="NVIDIA-L4", count=2), GpuGroup(product="NVIDIA-RTX-A6000", count=1),
        GpuGroup(product="Tesla-P40", count=3), GpuGroup(product="Tesla-P100-PCIE-16GB", count=2),
    ], network_bandwidth_bytes_per_second=50e9 / 8)
    problem = build_problem(job_spec(64, "gpt-6.7b"), cluster)
    found, _, searches = search_even_sets(problem)
    assert found is not None
    layers = problem.model.num_layers
    exhaustive = []
    for even in even_unit_options(layers):
        with contextlib.suppress(InfeasibleError):
            exhaustive.append(solve_fixed_with(problem, even))
    assert found.result.threshold_seconds == pytest.approx(min(exhaustive), rel=1e-12)
    assert 0 < found.even.count() < layers + 2
    assert searches < 4 * (layers + 1) / 4


def test_uneven_overhead_is_charged_per_skewed_unit() -> None:
    """With no overlap a step is compute plus every collective, so the mixed plan costs the
    all-even one plus exactly the overhead on the skewed units' collectives."""
    spec = job_spec(4, "gpt-tiny")
    model = spec.model.resolve()
    comm = CommModel(1e8, 1e-4, uneven_overhead=0.15, overlap_fraction=0.0)
    problem = build_problem(spec, _two_gpus())
    cost = problem.classes[0].cost
    one = np.ones(1)

    def step(c: UnitComm) -> float:
        return float(cost.step_seconds(one, one, c)[0])

    flat = UnitComm.build(model, comm, 2, uneven=False)
    skewed = UnitComm.build(model, comm, 2, uneven=True)
    assert mixed_unit_comm(model, comm, 2, EvenUnits.all(model.num_layers)) == flat
    assert mixed_unit_comm(model, comm, 2, EvenUnits.none()) == skewed
    layers = model.num_layers
    for even in even_unit_options(layers):
        mixed = mixed_unit_comm(model, comm, 2, even)
        extra = 0.15 * (
            (layers - even.blocks) * (2 * flat.ag_block + flat.rs_block)
            + (0 if even.embedding else 2 * flat.ag_first + _rs(model, comm, "emb"))
            + (0 if even.head else flat.ag_head + _rs(model, comm, "head")))
        assert step(mixed) - step(flat) == pytest.approx(extra, rel=1e-9, abs=1e-15)


def _rs(model, comm: CommModel, which: str) -> float:
    from cephalo.api.memory import COMM_BYTES_PER_PARAMETER

    params = model.embedding_parameters() if which == "emb" else model.head_parameters()
    return comm.ring_seconds(params * COMM_BYTES_PER_PARAMETER, 2, False, "reduce_scatter")


def _two_gpus():
    from cephalo.api import ClusterSpec, GpuGroup

    return ClusterSpec(groups=[GpuGroup(product="NVIDIA-L4", count=2)])


def test_plan_ratios_and_json() -> None:
    # Most units even: ranks carry 1/N, the skewed units are listed.
    ratios, per_unit = unit_shard_ratios(EvenUnits(True, True, 3), 4, 2, [0.7, 0.3])
    assert ratios == [0.5, 0.5] and per_unit == {"4": [0.7, 0.3]}
    # Most skewed: ranks carry the skewed ratios, the even units are listed.
    ratios, per_unit = unit_shard_ratios(EvenUnits(True, False, 0), 4, 2, [0.7, 0.3])
    assert ratios == [0.7, 0.3] and per_unit == {"0": [0.5, 0.5]}
    assert unit_shard_ratios(EvenUnits.none(), 4, 2, [0.7, 0.3]) == ([0.7, 0.3], {})
    assert unit_shard_ratios(EvenUnits.all(4), 4, 2, [0.7, 0.3]) == ([0.5, 0.5], {})
    # A uniform plan's JSON has no unit_shard_ratios key (same bytes as before).
    spec, cluster, profiles = random_instance(MIXED_SEEDS[0], max_gpus=3, max_batch=8)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    data = json.loads(plan.to_json())
    assert set(data["unit_shard_ratios"]) and parse_plan(data) == plan
    data.pop("unit_shard_ratios")
    assert "unit_shard_ratios" not in parse_plan(data).to_json()
    # Every rank's predicted memory is its compute plus its share of each unit's state.
    model = spec.model.resolve()
    units = model.unit_parameters()
    per_param = plan.state_bytes / model.total_parameters()
    for r in plan.ranks:
        held = 0.0
        for u, numel in enumerate(units):
            ratios = plan.unit_shard_ratios.get(str(u), [x.shard_ratio for x in plan.ranks])
            start, end = shard_bounds(numel, ratios)[r.rank]
            held += (end - start) * per_param
        compute = r.compute_memory_bytes
        assert r.predicted_memory_bytes == pytest.approx(compute + held, rel=1e-3, abs=64)
        assert r.predicted_memory_bytes <= r.memory_capacity_bytes * plan.memory_fraction + 1
    text = format_plan(plan, "gpt-tiny")
    layers = model.num_layers
    even = sum(1 for u in range(layers + 2)
               if all(abs(x - 1 / plan.world_size) < 1e-12 for x in plan.unit_shard_ratios.get(
                   str(u), [x.shard_ratio for x in plan.ranks])))
    assert f"units: {even} of {layers + 2} sharded evenly, {layers + 2 - even} skewed" in text
