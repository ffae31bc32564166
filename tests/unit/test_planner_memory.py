"""The planner's memory stays bounded as the global batch B grows (issue 11: B = 10^6 took
3.7 GB; the min-plus step reduced a 256 x B block at once)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from cephalo.planner.search import bottleneck


def _reference_minplus(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = x.size
    return np.array([min(x[i] + y[s - i] for i in range(s + 1)) for s in range(n)])


@pytest.mark.parametrize("block_bytes", [8, 1024, bottleneck.MINPLUS_BLOCK_BYTES])
def test_minplus_is_exact_whatever_the_block(monkeypatch: pytest.MonkeyPatch,
                                             block_bytes: int) -> None:
    rng = np.random.default_rng(3)
    x, y = rng.random(97), rng.random(97)
    x[rng.random(97) < 0.3] = np.inf  # unreachable batches
    monkeypatch.setattr(bottleneck, "MINPLUS_BLOCK_BYTES", block_bytes)
    np.testing.assert_array_equal(bottleneck._minplus(x, y), _reference_minplus(x, y))


def test_minplus_memory_does_not_grow_with_rows_times_batch() -> None:
    n = 262_144
    x = np.full(n, np.inf)
    x[:600] = np.arange(600.0)  # 600 finite rows: the old 256-row blocks held 512 MiB
    y = np.random.default_rng(0).random(n)
    tracemalloc.start()
    try:
        bottleneck._minplus(x, y)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The block budget three times (the gathered rows, their sum with x, its minimum) plus a
    # few B-sized vectors: ~70 MiB, where 256-row blocks took 1 GiB.
    assert peak_bytes < 3 * bottleneck.MINPLUS_BLOCK_BYTES + 12 * n * 8, peak_bytes / 2**20


def _binding_cases(count: int):
    """Random instances whose aggregate memory constraint binds (water-filled shards)."""
    from cephalo.planner.search.problem import build_problem, class_tables

    from .planner_instances import random_instance

    seed = 0
    while count:
        seed += 1
        spec, cluster, profiles = random_instance(seed, max_gpus=8, max_batch=160)
        problem = build_problem(spec, cluster, profiles)
        if problem.world_size < 2:
            continue
        tables = class_tables(problem, uneven=True)
        room = problem.total_budget_bytes - problem.state_bytes
        exact = bottleneck.min_bottleneck(tables, problem.global_batch_size, room)
        if exact is not None and exact.memory_checked_exactly:
            count -= 1
            yield tables, problem.global_batch_size, room, exact


@pytest.mark.parametrize("close_ops", [0.0, bottleneck.EXACT_CLOSE_MAX_OPS])
def test_large_batch_memory_search_is_bounded_by_the_exact_one(
        monkeypatch: pytest.MonkeyPatch, close_ops: float) -> None:
    """The Lagrangian search (used above EXACT_MINPLUS_MAX_BATCH) against the exact min-plus:
    its plan's threshold is feasible (its split sums to B and fits the room), at least the
    exact optimum, and its lower bound at most that optimum. Where the exact check is
    affordable it closes any gap; without it (close_ops 0) the bound alone is shown."""
    cases = list(_binding_cases(25))
    monkeypatch.setattr(bottleneck, "EXACT_MINPLUS_MAX_BATCH", 0)
    monkeypatch.setattr(bottleneck, "EXACT_CLOSE_MAX_OPS", close_ops)
    exact_hits = 0
    for tables, batch, room, exact in cases:
        bounded = bottleneck.min_bottleneck(tables, batch, room)
        assert bounded is not None
        assert bounded.lower_bound_seconds <= exact.threshold_seconds <= \
            bounded.threshold_seconds
        assert sum(sum(b) for b in bounded.batches) == batch
        assert [len(b) for b in bounded.batches] == [t.count for t in tables]
        assert bottleneck._split_memory(tables, bounded.threshold_seconds, bounded.batches) <= room
        exact_hits += bounded.gap_seconds == 0.0
        if close_ops:
            assert bounded.threshold_seconds == exact.threshold_seconds
    # Few GPUs are the Lagrangian bound's worst case (the duality gap shrinks with N).
    assert exact_hits >= (len(cases) if close_ops else len(cases) // 3), exact_hits
