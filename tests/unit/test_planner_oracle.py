"""The solver against brute force: on many small random instances, the fixed-GPU solver's
predicted step time equals the exhaustive optimum of the planner's scoring over every
assignment, and `solve`'s equals the least of those over every subset of the GPUs (the
planner chooses which GPUs to use)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cephalo.api import ClusterSpec, GpuGroup
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.evaluate import score
from cephalo.planner.problem import build_problem, without_recompute
from cephalo.planner.solver import solve_fixed
from cephalo.planner.unit_shards import EvenUnits

from .planner_instances import random_instance


def _options(batch: int, allow_zero: bool) -> dict[int, list[tuple[int, int]]]:
    """For each per-GPU batch b, every (m, ℓ) with m·ℓ = b."""
    out: dict[int, list[tuple[int, int]]] = {0: [(0, 0)]} if allow_zero else {}
    for b in range(1, batch + 1):
        out[b] = [(m, b // m) for m in range(1, b + 1) if b % m == 0]
    return out


def brute_force(spec, cluster, profiles) -> float | None:
    """Least step time over all assignments, every choice of which units are sharded
    evenly (the rest skewed) and both recompute modes (job-wide), using `score` as the
    truth."""
    recomputing = build_problem(spec, cluster, profiles)
    found = [_brute_force_mode(problem) for problem in (recomputing,
                                                        without_recompute(recomputing))]
    finite = [f for f in found if f is not None]
    return min(finite) if finite else None


def _brute_force_mode(problem) -> float | None:
    n, batch = problem.world_size, problem.global_batch_size
    options = _options(batch, problem.allow_state_only)
    layers = problem.model.num_layers
    # Every subset of the units, as what the cost model sees of it (blocks are identical).
    even_sets = {EvenUnits(0 in s, layers + 1 in s, sum(1 for u in s if 1 <= u <= layers))
                 for k in range(layers + 3)
                 for s in itertools.combinations(range(layers + 2), k)}
    best = math.inf
    for split in itertools.product(sorted(options), repeat=n):
        if sum(split) != batch:
            continue
        for choice in itertools.product(*(options[b] for b in split)):
            micro = [m for m, _ in choice]
            ell = [count for _, count in choice]
            for even in even_sets:
                ev = score(problem, micro, ell, even_units=even)
                if ev.feasible:
                    best = min(best, ev.step_seconds)
    return None if math.isinf(best) else best


def sub_clusters(cluster: ClusterSpec):
    """Every nonempty subset of the cluster's GPUs, one GPU per group, in cluster order."""
    gpus = [g for g in cluster.groups for _ in range(g.count)]
    for mask in itertools.product((False, True), repeat=len(gpus)):
        if any(mask):
            yield ClusterSpec(groups=[GpuGroup(product=g.product, count=1,
                                               memory_bytes=g.memory_bytes)
                                      for g, keep in zip(gpus, mask, strict=True) if keep])


def brute_force_subsets(spec, cluster, profiles) -> float | None:
    found = [brute_force(spec, sub, profiles) for sub in sub_clusters(cluster)]
    finite = [f for f in found if f is not None]
    return min(finite) if finite else None


def _check_against_brute_force(seed: int, max_gpus: int, max_batch: int) -> None:
    spec, cluster, profiles = random_instance(seed, max_gpus=max_gpus, max_batch=max_batch)
    # All GPUs used: the core search is exact, in each recompute mode.
    recomputing = build_problem(spec, cluster, profiles)
    for problem in (recomputing, without_recompute(recomputing)):
        expected = _brute_force_mode(problem)
        if expected is None:
            with pytest.raises(InfeasibleError):
                solve_fixed(problem)
        else:
            sol = solve_fixed(problem)
            got = score(problem, sol.micro, sol.ell, even_units=sol.even_units).step_seconds
            assert got == pytest.approx(expected, rel=1e-12)
    # The planner's choice of GPUs: the optimum over every subset.
    best = brute_force_subsets(spec, cluster, profiles)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve(spec, cluster, profiles, choose_gpus=True)
        return
    plan = solve(spec, cluster, profiles, choose_gpus=True)
    assert plan.predicted_step_seconds == pytest.approx(best, rel=1e-12)
    assert plan.world_size + sum(i.count for i in plan.idle_gpus) == cluster.num_gpus
    assert plan.search["exact"] is True and plan.optimality_gap_seconds == 0.0


@pytest.mark.parametrize("seed", range(60))
def test_solve_matches_brute_force(seed: int) -> None:
    _check_against_brute_force(seed, max_gpus=3, max_batch=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=1000, max_value=10**6))
def test_solve_matches_brute_force_four_gpus(seed: int) -> None:
    _check_against_brute_force(seed, max_gpus=4, max_batch=7)
