"""The solver against brute force: on many small random instances, the fixed-GPU solver's
predicted step time equals the exhaustive optimum of the planner's scoring over every
assignment (kept-block counts included) in each job-wide mode, and `solve`'s equals the least
of those over the modes and every subset of the GPUs (the planner chooses which GPUs to
use)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cephalo.api import ClusterSpec, GpuGroup
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.evaluate import score
from cephalo.planner.problem import Problem, build_problem, fused_everything, without_recompute
from cephalo.planner.solver import solve_fixed

from .planner_brute import brute_force_seconds
from .planner_instances import random_instance


def brute_force(spec, cluster, profiles) -> float | None:
    """Least step time over all assignments (with every kept-block count per rank in
    recompute mode), every choice of which units are sharded evenly (the rest skewed) and
    both recompute modes (job-wide), with `score` as the truth (planner_brute.py)."""
    found = [_brute_force_mode(problem) for problem in _modes(spec, cluster, profiles)]
    finite = [f for f in found if f is not None]
    return min(finite) if finite else None


def _modes(spec, cluster, profiles) -> list[Problem]:
    """The job priced in each job-wide mode: recompute (kept blocks per rank), every block
    in the engine's fused tail (where a graph size is known), keeping everything."""
    recomputing = build_problem(spec, cluster, profiles)
    fused = fused_everything(recomputing)
    return [recomputing, *([] if fused is None else [fused]), without_recompute(recomputing)]


def _brute_force_mode(problem) -> float | None:
    return brute_force_seconds(problem)


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
    # All GPUs used: the core search is exact, in each mode.
    for problem in _modes(spec, cluster, profiles):
        expected = _brute_force_mode(problem)
        if expected is None:
            with pytest.raises(InfeasibleError):
                solve_fixed(problem)
        else:
            sol = solve_fixed(problem)
            got = score(problem, sol.micro, sol.ell, even_units=sol.even_units,
                        kept=sol.kept).step_seconds
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
