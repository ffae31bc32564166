"""Scoring one assignment under the cost model, and the training-state partition.

`evaluate` is the ground truth the solver optimises: the solver's plan is the assignment of
least `step_seconds` among all feasible ones (tests check it against brute force)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.profile import GpuProfile
from cephalo.planner.problem import Problem, build_problem, gib

# Floating-point slack when comparing memory to a budget (bytes are ~1e10; this is 1 B/GiB).
_MEMORY_RTOL = 1e-9


@dataclass
class Evaluation:
    feasible: bool
    reason: str | None
    step_seconds: float
    rank_seconds: list[float]
    rank_compute_bytes: list[float]
    rank_memory_bytes: list[float]
    shard_ratios: list[float]
    global_batch_size: int

    @property
    def samples_per_second(self) -> float | None:
        return self.global_batch_size / self.step_seconds if self.feasible else None


def water_fill(compute_bytes: Sequence[float], budgets: Sequence[float],
               state_bytes: float) -> list[float]:
    """Shard ratios minimising the maximum memory utilisation (compute + share) / budget.

    The continuous optimum of the paper's greedy: raise a common utilisation level u and
    give every GPU below it the state that brings it up to u, until the state is placed."""
    n = len(compute_bytes)
    order = sorted(range(n), key=lambda i: (compute_bytes[i] / budgets[i], i))
    used_compute = used_budget = 0.0
    level = 0.0
    for k, i in enumerate(order):
        used_compute += compute_bytes[i]
        used_budget += budgets[i]
        level = (state_bytes + used_compute) / used_budget
        nxt = order[k + 1] if k + 1 < n else None
        if nxt is None or level <= compute_bytes[nxt] / budgets[nxt]:
            break
    shares = [max(0.0, level * budgets[i] - compute_bytes[i]) for i in range(n)]
    total = sum(shares)
    ratios = [s / total for s in shares]
    # Make the sum exactly 1 in floating point by giving the rounding residue to the largest.
    largest = max(range(n), key=lambda i: ratios[i])
    ratios[largest] = 1.0 - (sum(ratios) - ratios[largest])
    return ratios


def score(problem: Problem, micro: Sequence[int], ell: Sequence[int],
          shard_ratios: Sequence[float] | None = None, *, even_shards: bool = False,
          layered: bool = True) -> Evaluation:
    """Step time and memory of one assignment (per rank: microbatch size m and count ℓ)."""
    n = problem.world_size
    micro_arr = np.asarray(micro, dtype=np.int64)
    ell_arr = np.asarray(ell, dtype=np.int64)
    comm = problem.unit_comm(uneven=not even_shards and n > 1)
    seconds, compute = [], []
    for rank in range(n):
        cost = problem.rank_cost(rank)
        fn = cost.step_seconds if layered else cost.accumulation_step_seconds
        seconds.append(float(fn(ell_arr[rank:rank + 1], micro_arr[rank:rank + 1], comm)[0]))
        compute.append(float(cost.compute_memory_bytes(micro_arr[rank:rank + 1])[0]))
    budgets = [problem.rank_budget(r) for r in range(n)]
    state = problem.state_bytes
    reason = None
    total_batch = int((micro_arr * ell_arr).sum())
    if total_batch != problem.global_batch_size:
        reason = f"batch sizes sum to {total_batch}, not {problem.global_batch_size}"
    over = [r for r in range(n) if compute[r] > budgets[r] * (1 + _MEMORY_RTOL)]
    if shard_ratios is not None:
        ratios = list(shard_ratios)
    elif even_shards or over:  # over budget already: any partition fails, report it evenly
        ratios = [1.0 / n] * n
    else:
        ratios = water_fill(compute, budgets, state)
    memory = [compute[r] + ratios[r] * state for r in range(n)]
    if reason is None:
        for r in range(n):
            if memory[r] > budgets[r] * (1 + _MEMORY_RTOL):
                gpu = problem.ranks[r][0]
                reason = (f"rank {r} ({gpu}) needs {gib(memory[r])} (training state "
                          f"{gib(ratios[r] * state)} + compute {gib(compute[r])} at microbatch "
                          f"{micro_arr[r]}), more than its {gib(budgets[r])} at "
                          f"{problem.memory_fraction:.0%} of memory")
                break
    return Evaluation(reason is None, reason, max(seconds), seconds, compute, memory, ratios,
                      problem.global_batch_size)


def evaluate(spec: CephaloJobSpec, cluster: ClusterSpec,
             profiles: Mapping[str, GpuProfile] | None,
             assignment: Sequence[tuple[int, int]],
             shard_ratios: Sequence[float] | None = None, *,
             even_shards: bool = False) -> Evaluation:
    """Score a given assignment — one (micro_batch_size, num_micro_batches) per GPU in the
    cluster's order; (0, 0) for a state-only GPU — under the planner's cost model.
    Without `shard_ratios` the state is partitioned as the planner would (`score_best`)."""
    problem = build_problem(spec, cluster, profiles)
    if len(assignment) != problem.world_size:
        raise ValueError(f"assignment has {len(assignment)} entries for "
                         f"{problem.world_size} GPUs")
    micro = [m for m, _ in assignment]
    ell = [count for _, count in assignment]
    if shard_ratios is not None or even_shards:
        return score(problem, micro, ell, shard_ratios, even_shards=even_shards)
    return score_best(problem, micro, ell)


def score_best(problem: Problem, micro: Sequence[int], ell: Sequence[int]) -> Evaluation:
    """The better of the two partitions the planner considers: even shards (no uneven
    collective overhead, if 1/N of the state fits everywhere) or water-filled shards."""
    even = score(problem, micro, ell, even_shards=True)
    uneven = score(problem, micro, ell)
    if even.feasible and (not uneven.feasible or even.step_seconds <= uneven.step_seconds):
        return even
    return uneven
