"""Which units to shard evenly, searched jointly with the batch split: branch and bound
over the even sets of unit_shards.py.

For each embedding/head choice the even blocks k run over 0..L. An interval [k1, k2] of
them is bounded from below by one search on a relaxation: the configurations that fit with
k1 even blocks (the most memory left, a superset of those for any k in the interval) priced
with the collectives of k2 even blocks (no slower than any k in it: an even unit's
collectives are never slower than a skewed one's, and a unit's time never decreases with
its collective). Intervals whose bound cannot beat the best plan found are dropped; the
others are halved, best bound first, down to single even sets, which are searched exactly.
An interval that can at best tie the best plan is dropped too: among equally fast sets
the one with more even units wins, among the sets searched.
All-even and all-skewed (today's two partitions) are searched first, then one relaxation
bounding every even set; when it cannot beat them (the usual case: memory to spare, or
collectives hidden under compute) that is all, three searches. The result is never slower
than the better of all-even and all-skewed, and exact over all 4 (L + 1) even sets.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from cephalo.planner.search.bottleneck import ClassTable, SearchResult, min_bottleneck
from cephalo.planner.search.problem import Problem, class_tables
from cephalo.planner.search.unit_shards import EvenUnits, even_state_bytes, mixed_unit_comm

# Step times this close are a tie (the same sum added in another order differs in the last
# bits): the tie goes to more even units.
_TIE_RTOL = 1e-12


def _tied(a: float, b: float) -> bool:
    return abs(a - b) <= _TIE_RTOL * max(abs(a), abs(b))


@dataclass
class EvenSetResult:
    even: EvenUnits
    tables: list[ClassTable]
    room_bytes: float  # aggregate memory room for compute
    result: SearchResult
    uneven_units: int


def even_set_tables(problem: Problem, even: EvenUnits,
                    comm_even: EvenUnits | None = None) -> tuple[list[ClassTable], float]:
    """The configurations each class may run with `even`'s units sharded 1/N, priced with
    the collectives of `comm_even` (default `even`), and the aggregate memory room left for
    compute (infinite when every unit is even: the per-GPU check then implies it). In
    recompute mode they include the kept-block counts that fit (kept_blocks.py): more
    even blocks never make a kept block slower, so the relaxation's bound still holds."""
    n = problem.world_size
    comm_even = comm_even or even
    if n == 1 or even.is_all(problem.model.num_layers):
        return class_tables(problem, uneven=False, state_share_bytes=problem.state_bytes / n,
                            kept_blocks=True), float("inf")
    room = problem.total_budget_bytes - problem.state_bytes
    if even == EvenUnits.none() and comm_even == even:
        return class_tables(problem, uneven=True, kept_blocks=True), room
    share = even_state_bytes(problem.model, problem.precision, even) / n
    comm = mixed_unit_comm(problem.model, problem.comm_model, n, comm_even)
    return class_tables(problem, state_share_bytes=share, comm=comm, kept_blocks=True), room


def search_even_sets(problem: Problem) -> tuple[EvenSetResult | None, float, int]:
    """(the fastest even set and its search, the least proven lower bound over every even
    set searched exactly, number of searches run). Ties go to more even units."""
    layers = problem.model.num_layers
    num_units = layers + 2
    batch = problem.global_batch_size
    best: EvenSetResult | None = None
    lowers: list[float] = []
    searches = 0

    def better(a: EvenSetResult, b: EvenSetResult | None) -> bool:
        if b is None:
            return True
        ta, tb = a.result.threshold_seconds, b.result.threshold_seconds
        if _tied(ta, tb):
            return (a.uneven_units, a.even) < (b.uneven_units, b.even)
        return ta < tb

    def leaf(even: EvenUnits) -> None:
        nonlocal best, searches
        tables, room = even_set_tables(problem, even)
        searches += 1
        found = min_bottleneck(tables, batch, room)
        if found is None:
            return
        lowers.append(found.lower_bound_seconds)
        candidate = EvenSetResult(even, tables, room, found, num_units - even.count())
        if better(candidate, best):
            best = candidate

    leaf(EvenUnits.all(layers))
    if problem.world_size == 1:
        return best, min(lowers, default=0.0), searches
    leaf(EvenUnits.none())
    # (bound, interval width, fewer even units first negated, embedding, head, lo, hi): the
    # bound is the parent's until the interval is popped (bounds are computed lazily, so
    # an interval whose parent's bound already loses costs no search); narrower first
    # among equal bounds, so the search dives to a plan before widening.
    heap: list[tuple[float, int, int, bool, bool, int, int]] = []

    def loses(bound: float) -> bool:
        """Nothing under `bound` beats the best plan (a tie does not: see above)."""
        return best is not None and (bound > best.result.threshold_seconds or
                                     _tied(bound, best.result.threshold_seconds))

    def push(bound: float, embedding: bool, head: bool, lo: int, hi: int) -> None:
        most = EvenUnits(embedding, head, hi).count()
        heapq.heappush(heap, (bound, hi - lo, -most, embedding, head, lo, hi))

    # One relaxation bounds every even set at once (no unit's 1/N reserved, every collective
    # even): when it cannot beat the better of all-even and all-skewed, nothing can.
    tables, room = even_set_tables(problem, EvenUnits.none(), comm_even=EvenUnits.all(layers))
    searches += 1
    found = min_bottleneck(tables, batch, room)
    if found is None or loses(found.lower_bound_seconds):
        return best, min(lowers, default=0.0), searches
    for embedding in (False, True):
        for head in (False, True):
            push(found.lower_bound_seconds, embedding, head, 0, layers)
    while heap:
        bound, _, _, embedding, head, lo, hi = heapq.heappop(heap)
        if loses(bound):
            continue
        if lo == hi:
            if EvenUnits(embedding, head, lo) not in (EvenUnits.all(layers), EvenUnits.none()):
                leaf(EvenUnits(embedding, head, lo))
            continue
        tables, room = even_set_tables(problem, EvenUnits(embedding, head, lo),
                                       comm_even=EvenUnits(embedding, head, hi))
        searches += 1
        found = min_bottleneck(tables, batch, room)
        if found is None or loses(found.lower_bound_seconds):
            continue  # no k in [lo, hi] fits, or none is faster than the best plan
        mid = (lo + hi) // 2
        push(found.lower_bound_seconds, embedding, head, lo, mid)
        push(found.lower_bound_seconds, embedding, head, mid + 1, hi)
    return best, min(lowers, default=0.0), searches
