"""Brute force over every assignment of a small planning problem: per rank every (m, ℓ)
with m·ℓ = b for every b (or state only) and, in recompute mode, every kept-block count
0..L, for every set of evenly sharded units. Times and memory come from the cost model's
own functions, vectorised over all combinations; the memory test here is a relaxation of
`score`'s (a looser tolerance), so combinations are confirmed with `score`, the planner's
truth, in order of step time: the first `score` accepts is the optimum."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from cephalo.planner.search.evaluate import score
from cephalo.planner.search.problem import Problem
from cephalo.planner.search.unit_shards import EvenUnits, even_state_bytes, mixed_unit_comm

# Looser than score's 1e-9: the vectorised test may only let more combinations through.
_RELAXED_RTOL = 1e-6


@dataclass
class Optimum:
    step_seconds: float
    micro: list[int]
    ell: list[int]
    kept: list[int]
    even: EvenUnits


def even_sets(num_layers: int) -> set[EvenUnits]:
    """Every subset of the units, as what the cost model sees of it (blocks identical)."""
    return {EvenUnits(0 in s, num_layers + 1 in s, sum(1 for u in s if 1 <= u <= num_layers))
            for k in range(num_layers + 3)
            for s in itertools.combinations(range(num_layers + 2), k)}


def _comm_and_share(problem: Problem, even: EvenUnits):  # type: ignore[no-untyped-def]
    """The collectives and the per-rank state reserved for `even`, as `score` prices them."""
    n, layers = problem.world_size, problem.model.num_layers
    if n == 1 or even.is_all(layers):  # hybrid: 1/k of the state, k the group's ranks
        return problem.unit_comm(uneven=False), \
            problem.state_bytes / problem.shard_group_size, True
    if even == EvenUnits.none():
        return problem.unit_comm(uneven=True), 0.0, False
    share = even_state_bytes(problem.model, problem.precision, even) / n
    return mixed_unit_comm(problem.model, problem.comm_model, n, even), share, False


def _candidates(problem: Problem, cls, kept_blocks: bool):  # type: ignore[no-untyped-def]
    """(m, ℓ, k, memory) arrays of every candidate of one class: the same for every even
    set (only the seconds and the room depend on it), so built once per class."""
    batch, layers = problem.global_batch_size, problem.model.num_layers
    pairs = [(0, 0)] if problem.allow_state_only else []
    pairs += [(m, b // m) for b in range(1, batch + 1) for m in range(1, b + 1) if b % m == 0]
    keeps = range(layers + 1) if kept_blocks and cls.cost.recompute else range(1)
    rows = np.array([(m, ell, k) for m, ell in pairs for k in keeps if m or not k],
                    dtype=np.int64).reshape(-1, 3)
    m, ell, k = rows.T
    return m, ell, k, cls.cost.compute_memory_bytes(m, ell, k)


def _options(cls, candidates, comm, share: float):  # type: ignore[no-untyped-def]
    """(batch, seconds, memory, m, ℓ, k) arrays of one class's candidates within its room."""
    m, ell, k, memory = candidates
    seconds = cls.cost.step_seconds(ell, m, comm, k)
    ok = memory + share <= cls.budget_bytes * (1 + _RELAXED_RTOL)
    return m[ok] * ell[ok], seconds[ok], memory[ok], m[ok], ell[ok], k[ok]


def brute_force_optimum(problem: Problem, kept_blocks: bool = True) -> Optimum | None:
    """The least step time over every assignment (None: nothing fits). `kept_blocks`
    False leaves every rank at k = 0 (the recompute-only optimum). A problem in replica
    groups (hybrid) shards every unit evenly inside its group: that set only."""
    n, batch = problem.world_size, problem.global_batch_size
    total_budget = sum(problem.rank_budget(r) for r in range(n))
    found: list[tuple[float, EvenUnits, list[int], list[int], list[int]]] = []
    layers = problem.model.num_layers
    sets = [EvenUnits.all(layers)] if problem.groups else sorted(even_sets(layers))
    candidates = [_candidates(problem, cls, kept_blocks) for cls in problem.classes]
    for even in sets:
        comm, share, all_even = _comm_and_share(problem, even)
        options = [_options(cls, cands, comm, share)
                   for cls, cands in zip(problem.classes, candidates, strict=True)]
        # Partial combinations over ranks 0..r: batch, slowest time, memory, chosen rows.
        sums, slowest, used = np.zeros(1, np.int64), np.full(1, -math.inf), np.zeros(1)
        rows = np.zeros((1, 0), dtype=np.int64)
        for rank in range(n):
            b, sec, mem = options[problem.rank_class[rank]][:3]
            size = b.size
            new_sums = (sums[:, None] + b[None, :]).ravel()
            keep = new_sums <= batch if rank < n - 1 else new_sums == batch
            parent, child = np.divmod(np.flatnonzero(keep), size)
            sums = new_sums[keep]
            slowest = np.maximum(slowest[parent], sec[child])
            used = used[parent] + mem[child]
            rows = np.concatenate([rows[parent], child[:, None]], axis=1)
        if not all_even:
            fits = used <= total_budget * (1 + _RELAXED_RTOL) - problem.state_bytes
            slowest, rows = slowest[fits], rows[fits]
        picks = [options[problem.rank_class[r]] for r in range(n)]
        for i in np.argsort(slowest, kind="stable"):
            micro = [int(picks[r][3][rows[i, r]]) for r in range(n)]
            ell = [int(picks[r][4][rows[i, r]]) for r in range(n)]
            kept = [int(picks[r][5][rows[i, r]]) for r in range(n)]
            ev = score(problem, micro, ell, even_units=even, kept=kept)
            if ev.feasible:
                found.append((ev.step_seconds, even, micro, ell, kept))
                break
    if not found:
        return None
    seconds, even, micro, ell, kept = min(found, key=lambda f: f[0])
    return Optimum(seconds, micro, ell, kept, even)


def brute_force_seconds(problem: Problem, kept_blocks: bool = True) -> float | None:
    best = brute_force_optimum(problem, kept_blocks)
    return None if best is None else best.step_seconds
