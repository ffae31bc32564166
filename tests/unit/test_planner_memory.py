"""The planner's memory stays bounded as the global batch B grows (issue 11: B = 10^6 took
3.7 GB; the min-plus step reduced a 256 x B block at once)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from cephalo.planner import search


def _reference_minplus(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = x.size
    return np.array([min(x[i] + y[s - i] for i in range(s + 1)) for s in range(n)])


@pytest.mark.parametrize("block_bytes", [8, 1024, search.MINPLUS_BLOCK_BYTES])
def test_minplus_is_exact_whatever_the_block(monkeypatch: pytest.MonkeyPatch,
                                             block_bytes: int) -> None:
    rng = np.random.default_rng(3)
    x, y = rng.random(97), rng.random(97)
    x[rng.random(97) < 0.3] = np.inf  # unreachable batches
    monkeypatch.setattr(search, "MINPLUS_BLOCK_BYTES", block_bytes)
    np.testing.assert_array_equal(search._minplus(x, y), _reference_minplus(x, y))


def test_minplus_memory_does_not_grow_with_rows_times_batch() -> None:
    n = 262_144
    x = np.full(n, np.inf)
    x[:600] = np.arange(600.0)  # 600 finite rows: the old 256-row blocks held 512 MiB
    y = np.random.default_rng(0).random(n)
    tracemalloc.start()
    try:
        search._minplus(x, y)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The block budget three times (the gathered rows, their sum with x, its minimum) plus a
    # few B-sized vectors: ~70 MiB, where 256-row blocks took 1 GiB.
    assert peak_bytes < 3 * search.MINPLUS_BLOCK_BYTES + 12 * n * 8, peak_bytes / 2**20
