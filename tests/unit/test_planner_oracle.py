"""The solver against brute force: on many small random instances, the fixed-GPU solver's
predicted step time equals the exhaustive optimum of the planner's scoring over every
assignment (kept-block counts included) in each job-wide mode, and `solve`'s equals the least
of those over the modes and every subset of the GPUs (the planner chooses which GPUs to
use)."""

from __future__ import annotations

import itertools
import os

import pytest

from cephalo.api import ClusterSpec
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.search.evaluate import score
from cephalo.planner.search.problem import (
    Problem,
    build_problem,
    fused_everything,
    without_recompute,
)
from cephalo.planner.search.solver import solve_fixed

from .planner_brute import brute_force_seconds
from .planner_instances import random_instance, with_min_gain

# How many random instances of up to three and of four GPUs the oracle checks (seeds 0..
# and 10000..): 300 each in the suite (400 took about 150 s of a CI run's test time, and
# the suite must stay within 15 minutes on 2 cores); CEPHALO_ORACLE_INSTANCES=N checks N of
# each (README: several thousand, 0 mismatches).
ORACLE_INSTANCES = int(os.environ.get("CEPHALO_ORACLE_INSTANCES", "300"))


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
    """Every nonempty subset of the cluster's GPUs up to identical GPUs: how many of each
    group (which ones of a group does not matter: they are the same product and memory)."""
    for counts in itertools.product(*(range(g.count + 1) for g in cluster.groups)):
        if any(counts):
            yield ClusterSpec(groups=[g.model_copy(update={"count": k})
                                      for g, k in zip(cluster.groups, counts, strict=True)
                                      if k])


def expected_step(best: float, everything: float | None, min_gain: float) -> float:
    """planner.minGainToIdleGpus: every GPU unless the fastest subset beats it by more
    than the margin in throughput (or every GPU does not fit)."""
    if everything is not None and everything <= best * (1 + min_gain):
        return everything
    return best


def _check_against_brute_force(seed: int, max_gpus: int, max_batch: int) -> None:
    spec, cluster, profiles = random_instance(seed, max_gpus=max_gpus, max_batch=max_batch)
    # All GPUs used: the core search is exact, in each mode.
    per_mode = []
    for problem in _modes(spec, cluster, profiles):
        expected = _brute_force_mode(problem)
        per_mode.append(expected)
        if expected is None:
            with pytest.raises(InfeasibleError):
                solve_fixed(problem)
        else:
            sol = solve_fixed(problem)
            got = score(problem, sol.micro, sol.ell, even_units=sol.even_units,
                        kept=sol.kept).step_seconds
            assert got == pytest.approx(expected, rel=1e-12)
    # The planner's choice of GPUs: the optimum over every subset (no margin), and with the
    # default margin every GPU unless fewer are faster by more than it.
    # brute_force(spec, cluster, profiles), from the modes just searched (the same problems:
    # searching them again cost a fifth of this test's time).
    everything = min((f for f in per_mode if f is not None), default=None)
    found = [everything, *(brute_force(spec, sub, profiles) for sub in sub_clusters(cluster)
                           if sub.num_gpus < cluster.num_gpus)]
    finite = [f for f in found if f is not None]
    best = min(finite) if finite else None
    for min_gain in (0.0, spec.planner.min_gain_to_idle_gpus):
        job = with_min_gain(spec, min_gain)
        if best is None:
            with pytest.raises(InfeasibleError):
                solve(job, cluster, profiles, choose_gpus=True)
            return
        plan = solve(job, cluster, profiles, choose_gpus=True)
        assert plan.predicted_step_seconds == pytest.approx(
            expected_step(best, everything, min_gain), rel=1e-12), (seed, min_gain)
        assert plan.world_size + sum(i.count for i in plan.idle_gpus) == cluster.num_gpus
        assert plan.search["exact"] is True and plan.optimality_gap_seconds == 0.0


# Deterministic seeds, in chunks (one test each) so that a failure names its seeds and the
# suite's report stays short. Every mismatch found once is also a named regression below.
_CHUNK = 50


def _check_seeds(seeds: range, max_gpus: int, max_batch: int) -> None:
    failed = []
    for seed in seeds:
        try:
            _check_against_brute_force(seed, max_gpus=max_gpus, max_batch=max_batch)
        except AssertionError as err:
            failed.append(f"seed {seed}: {str(err).splitlines()[0]}")
    assert not failed, f"{len(failed)} of {len(seeds)} instances disagree: " + "; ".join(failed)


@pytest.mark.parametrize("first", range(0, ORACLE_INSTANCES, _CHUNK))
def test_solve_matches_brute_force(first: int) -> None:
    _check_seeds(range(first, first + _CHUNK), max_gpus=3, max_batch=8)


@pytest.mark.parametrize("first", range(0, ORACLE_INSTANCES, _CHUNK))
def test_solve_matches_brute_force_four_gpus(first: int) -> None:
    _check_seeds(range(10_000 + first, 10_000 + first + _CHUNK), max_gpus=4, max_batch=7)


def test_regression_seed_14863_two_l4_beat_all_three() -> None:
    """Found by a random seed in a fresh clone: 2xL4 + 1xT4, B = 2. Two L4 keeping both block
    graphs take 0.015814 s, all three 0.016162 s, yet the subset search pruned the pair: the
    kept-block knapsack in `reachable_samples` summed 2 x graph x (1/graph) = 1.9999999999999998
    samples < B = 2, a "proof" off by one rounding error. (Since issue 46 the assumed network
    is priced at NCCL's efficiency of its rate: 0.015826 s and 0.016178 s.)"""
    spec, cluster, profiles = random_instance(14863, max_gpus=4, max_batch=7)
    plan = solve(with_min_gain(spec, 0.0), cluster, profiles, choose_gpus=True)
    assert plan.predicted_step_seconds == pytest.approx(0.01582607529595595, rel=1e-12)
    assert [r.gpu for r in plan.ranks] == ["L4", "L4"]
    assert [(i.gpu, i.count) for i in plan.idle_gpus] == [("T4", 1)]
    # 2.2 % faster is within the default margin (5 %): every GPU, and the plan says both.
    kept = solve(spec, cluster, profiles, choose_gpus=True)
    assert kept.predicted_step_seconds == pytest.approx(0.01617847529595595, rel=1e-12)
    assert kept.world_size == 3 and not kept.idle_gpus
    assert any("0.01583 s per step against 0.01618 s, 2.2% more throughput" in n
               for n in kept.notes), kept.notes


@pytest.mark.parametrize("seed", [1013, 1130])
def test_regression_fused_tail_classes_without_small_batches(seed: int) -> None:
    """Found by the oracle at 2 x 1150 instances: in the fused-everything mode a class's
    smallest batch is several microbatches, and the search's necessary reachability test
    returned at the first such class without the others' largest batches, so the batch
    split began above the optimum (seed 1013: 0.0591 s instead of 0.0522 s; 1130: a worse
    even set at 0.07435 s instead of 0.07430 s)."""
    spec, cluster, profiles = random_instance(seed, max_gpus=3, max_batch=8)
    fused = _modes(spec, cluster, profiles)[1]
    assert fused.rank_cost(0).fused_all
    sol = solve_fixed(fused)
    got = score(fused, sol.micro, sol.ell, even_units=sol.even_units, kept=sol.kept)
    assert got.step_seconds == pytest.approx(brute_force_seconds(fused), rel=1e-12)
