"""The solver against brute force: on many small random instances, `solve`'s predicted step
time equals the exhaustive optimum of the planner's scoring over every assignment."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cephalo.planner import InfeasibleError, solve
from cephalo.planner.evaluate import score
from cephalo.planner.problem import build_problem

from .planner_instances import random_instance


def _options(batch: int, allow_zero: bool) -> dict[int, list[tuple[int, int]]]:
    """For each per-GPU batch b, every (m, ℓ) with m·ℓ = b."""
    out: dict[int, list[tuple[int, int]]] = {0: [(0, 0)]} if allow_zero else {}
    for b in range(1, batch + 1):
        out[b] = [(m, b // m) for m in range(1, b + 1) if b % m == 0]
    return out


def brute_force(spec, cluster, profiles) -> float | None:
    """Least step time over all assignments and both shardings, using `score` as the truth."""
    problem = build_problem(spec, cluster, profiles)
    n, batch = problem.world_size, problem.global_batch_size
    options = _options(batch, problem.allow_state_only)
    best = math.inf
    for split in itertools.product(sorted(options), repeat=n):
        if sum(split) != batch:
            continue
        for choice in itertools.product(*(options[b] for b in split)):
            micro = [m for m, _ in choice]
            ell = [count for _, count in choice]
            for even in (True, False):
                ev = score(problem, micro, ell, even_shards=even)
                if ev.feasible:
                    best = min(best, ev.step_seconds)
    return None if math.isinf(best) else best


def _check_against_brute_force(seed: int, max_gpus: int, max_batch: int) -> None:
    spec, cluster, profiles = random_instance(seed, max_gpus=max_gpus, max_batch=max_batch)
    expected = brute_force(spec, cluster, profiles)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve(spec, cluster, profiles)
        return
    plan = solve(spec, cluster, profiles)
    assert plan.predicted_step_seconds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_solve_matches_brute_force(seed: int) -> None:
    _check_against_brute_force(seed, max_gpus=3, max_batch=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=1000, max_value=10**6))
def test_solve_matches_brute_force_four_gpus(seed: int) -> None:
    _check_against_brute_force(seed, max_gpus=4, max_batch=7)
