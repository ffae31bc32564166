"""Scoring one assignment under the cost model, and the training-state partition.

`evaluate` is the ground truth the solver optimises: the solver's plan is the assignment of
least `step_seconds` among all feasible ones (tests check it against brute force)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cephalo.api import memory
from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.profile import GpuProfile
from cephalo.planner.search.problem import (
    Problem,
    build_problem,
    fused_everything,
    gib,
    subset_problem,
    without_recompute,
)
from cephalo.planner.search.unit_shards import EvenUnits, even_state_bytes, fits, mixed_unit_comm

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
    shard_ratios: list[float]  # of the skewed units (all units unless `even_units` says)
    global_batch_size: int
    # Units sharded evenly (1/N) whatever `shard_ratios` says; None: all units use them.
    even_units: EvenUnits | None = None

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
          layered: bool = True, even_units: EvenUnits | None = None,
          kept: Sequence[int] | None = None) -> Evaluation:
    """Step time and memory of one assignment (per rank: microbatch size m and count ℓ).

    `even_units` shards those units evenly and the rest by `shard_ratios` (default:
    water-filled over the memory the even units leave); all or none of the units is the
    same as `even_shards` True or False. `kept` (recompute mode): per rank, how many of the
    last blocks keep their graphs (RankPlan.kept_blocks); None: none."""
    n = problem.world_size
    layers = problem.model.num_layers
    if even_units is not None and (n == 1 or even_units.is_all(layers)):
        even_units, even_shards = None, True
    elif even_units == EvenUnits.none():
        even_units, even_shards = None, False
    micro_arr = np.asarray(micro, dtype=np.int64)
    ell_arr = np.asarray(ell, dtype=np.int64)
    kept_arr = None if kept is None or not any(kept) else np.asarray(kept, dtype=np.int64)
    if even_units is not None:
        comm = mixed_unit_comm(problem.model, problem.comm_model, n, even_units)
    else:
        comm = problem.unit_comm(uneven=not even_shards and n > 1)
    # One vectorised call per class of identical GPUs (elementwise: the same numbers as one
    # call per rank, at thousands of ranks far faster).
    seconds_arr, compute_arr = np.empty(n), np.empty(n)
    for cls in problem.classes:
        idx = np.asarray(cls.slots, dtype=np.int64)
        if kept_arr is None or not layered:
            fn = cls.cost.step_seconds if layered else cls.cost.accumulation_step_seconds
            seconds_arr[idx] = fn(ell_arr[idx], micro_arr[idx], comm)
            compute_arr[idx] = cls.cost.compute_memory_bytes(micro_arr[idx], ell_arr[idx])
        else:
            seconds_arr[idx] = cls.cost.step_seconds(ell_arr[idx], micro_arr[idx], comm,
                                                     kept_arr[idx])
            compute_arr[idx] = cls.cost.compute_memory_bytes(micro_arr[idx], ell_arr[idx],
                                                             kept_arr[idx])
    seconds, compute = seconds_arr.tolist(), compute_arr.tolist()
    budgets = [problem.rank_budget(r) for r in range(n)]
    state: float = problem.state_bytes
    reason = None
    total_batch = int((micro_arr * ell_arr).sum())
    if total_batch != problem.global_batch_size:
        reason = f"batch sizes sum to {total_batch}, not {problem.global_batch_size}"
    elif kept_arr is not None and (int(kept_arr.max()) > layers or int(kept_arr.min()) < 0
                                   or not problem.classes[0].cost.recompute):
        reason = (f"kept blocks must be 0..{layers} per rank, in recompute mode only; "
                  f"got {kept_arr.tolist()}")
    over = [r for r in range(n) if compute[r] > budgets[r] * (1 + _MEMORY_RTOL)]
    if even_units is not None:
        even_share = even_state_bytes(problem.model, problem.precision, even_units) / n
        fixed = [c + even_share for c in compute]
        state -= even_share * n  # what the skewed units hold
    else:
        fixed = compute
    if shard_ratios is not None:
        ratios = list(shard_ratios)
    elif even_shards or over:  # over budget already: any partition fails, report it evenly
        ratios = [1.0 / problem.shard_group_size] * n  # hybrid: 1/k within each group
    else:
        ratios = water_fill(fixed, budgets, state)
    memory = [fixed[r] + ratios[r] * state for r in range(n)]
    if reason is None:
        for r in range(n):
            if memory[r] > budgets[r] * (1 + _MEMORY_RTOL):
                gpu = problem.ranks[r][0]
                keeps = "" if kept_arr is None or not kept_arr[r] else \
                    f" keeping {kept_arr[r]} block graphs"
                reason = (f"rank {r} ({gpu}) needs {gib(memory[r])} (training state "
                          f"{gib(ratios[r] * state)} + compute {gib(compute[r])} at microbatch "
                          f"{micro_arr[r]}{keeps}), more than its {gib(budgets[r])} at "
                          f"{problem.memory_fraction:.0%} of memory")
                break
    return Evaluation(reason is None, reason, max(seconds), seconds, compute, memory, ratios,
                      problem.global_batch_size, even_units)


def evaluate(spec: CephaloJobSpec, cluster: ClusterSpec,
             profiles: Mapping[str, GpuProfile] | None,
             assignment: Sequence[tuple[int, int] | None],
             shard_ratios: Sequence[float] | None = None, *,
             even_shards: bool = False, recompute: bool | None = None,
             kept_blocks: Sequence[int] | None = None,
             replica_groups: Sequence[Sequence[int]] | None = None,
             replicated_fraction: float = 0.0) -> Evaluation:
    """Score a given assignment — one (micro_batch_size, num_micro_batches) per GPU in the
    cluster's order; (0, 0) for a state-only GPU, None for an idle one (no rank) — under
    the planner's cost model. Without `shard_ratios` the state is partitioned as the
    planner would (`score_best`); given, they are one per GPU used. `recompute` None scores
    it as the planner would choose (the faster feasible of both modes); True or False
    scores that mode only. `kept_blocks` (one per GPU used, recompute mode only: None
    scores the other mode without them) keeps those blocks' graphs per rank.
    `replica_groups` (a hybrid plan's, over the GPUs used in `assignment`'s order) scores
    it sharded evenly inside those groups (hybrid.py), with `replicated_fraction` of each
    slice's optimizer state kept in every group (the plan's `replicated_fraction`)."""
    if recompute is None:
        modes = [_evaluate(spec, cluster, profiles, assignment, shard_ratios, even_shards, mode,
                           kept_blocks if mode else None, replica_groups, replicated_fraction)
                 for mode in (True, False)]
        # Ties go to keeping everything (listed first), as in the solver.
        feasible = [ev for ev in (modes[1], modes[0]) if ev.feasible]
        return min(feasible, key=lambda ev: ev.step_seconds) if feasible else modes[0]
    return _evaluate(spec, cluster, profiles, assignment, shard_ratios, even_shards,
                     recompute, kept_blocks, replica_groups, replicated_fraction)


def _evaluate(spec: CephaloJobSpec, cluster: ClusterSpec,
              profiles: Mapping[str, GpuProfile] | None,
              assignment: Sequence[tuple[int, int] | None],
              shard_ratios: Sequence[float] | None, even_shards: bool,
              recompute: bool, kept_blocks: Sequence[int] | None = None,
              replica_groups: Sequence[Sequence[int]] | None = None,
              replicated_fraction: float = 0.0) -> Evaluation:
    problem = build_problem(spec, cluster, profiles)
    if not recompute:
        problem = without_recompute(problem)
    if len(assignment) != problem.world_size:
        raise ValueError(f"assignment has {len(assignment)} entries for "
                         f"{problem.world_size} GPUs")
    if any(a is None for a in assignment):
        problem = subset_problem(problem, [r for r, a in enumerate(assignment)
                                           if a is not None])
    used = [a for a in assignment if a is not None]
    if not used:
        raise ValueError("the assignment leaves every GPU idle")
    micro = [m for m, _ in used]
    ell = [count for _, count in used]
    if kept_blocks is not None and len(kept_blocks) != len(used):
        raise ValueError(f"kept_blocks has {len(kept_blocks)} entries for {len(used)} ranks")
    if recompute and kept_blocks is not None and \
            _engine_fuses_everything(problem, micro, ell, kept_blocks):
        fused = fused_everything(problem)  # the engine's fused tail, priced exactly
        if fused is not None:
            problem, kept_blocks = fused, None
    if replica_groups:  # hybrid: every unit sharded evenly inside each group
        problem = dataclasses.replace(problem, groups=[list(g) for g in replica_groups],
                                      replicated_fraction=replicated_fraction)
        return score(problem, micro, ell, even_shards=True, kept=kept_blocks)
    if shard_ratios is not None or even_shards:
        return score(problem, micro, ell, shard_ratios, even_shards=even_shards,
                     kept=kept_blocks)
    return score_best(problem, micro, ell, kept_blocks)


def score_best(problem: Problem, micro: Sequence[int], ell: Sequence[int],
               kept: Sequence[int] | None = None) -> Evaluation:
    """The best partition for this assignment: each unit even or skewed (unit_shards.py),
    least step time, ties to more even units.

    Exact over every even set: for fixed (m, ℓ) making a unit even never slows a rank
    (its collectives lose the uneven overhead), so for each of the four embedding/head
    choices only the most even blocks that fit need scoring."""
    even = score(problem, micro, ell, even_shards=True, kept=kept)
    best = even if even.feasible else score(problem, micro, ell, kept=kept)
    if problem.world_size == 1 or not best.feasible or best is even:
        return best
    rooms = [problem.rank_budget(r) - best.rank_compute_bytes[r]
             for r in range(problem.world_size)]
    for option in most_even_options(problem, rooms):
        ev = score(problem, micro, ell, even_units=option, kept=kept)
        if ev.feasible and ev.step_seconds <= best.step_seconds:
            best = ev
    return best


def most_even_options(problem: Problem, rooms: Sequence[float]) -> list[EvenUnits]:
    """Per embedding/head choice, the even set with the most blocks that fits `rooms`
    (memory per rank after compute), fewest even units first."""
    found = []
    for embedding in (False, True):
        for head in (False, True):
            lo, hi = -1, problem.model.num_layers  # largest k that fits, by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                option = EvenUnits(embedding, head, mid)
                if fits(problem.model, problem.precision, option, rooms,
                        problem.state_bytes, _MEMORY_RTOL):
                    lo = mid
                else:
                    hi = mid - 1
            if lo >= 0:
                found.append(EvenUnits(embedding, head, lo))
    return sorted(found, key=lambda e: e.count())


def _engine_fuses_everything(problem: Problem, micro: Sequence[int], ell: Sequence[int],
                             kept: Sequence[int]) -> bool:
    """Whether the engine runs every block of this assignment in its fused tail
    (memory.fused_tail_blocks with the graph sizes a plan would record)."""
    model, layers = problem.model, problem.model.num_layers
    working = [r for r in range(len(micro)) if micro[r] * ell[r] > 0]
    if layers == 0 or not working or any(kept[r] != layers for r in working):
        return False
    measured = [problem.rank_cost(r).profile.block_graph_bytes_per_sample
                for r in range(len(micro))]
    return memory.fused_tail_blocks(
        list(kept), [m * n for m, n in zip(micro, ell, strict=True)], list(micro),
        model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size,
        model.block_parameters(), measured) == layers
