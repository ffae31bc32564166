"""Exact minimum-bottleneck search over per-GPU (ℓ, m) choices.

The problem (the paper's formulation): choose for every GPU i a pair (ℓ_i, m_i) — or (0, 0)
for a state-only GPU — minimising max_i T_i(ℓ_i, m_i) subject to Σ ℓ_i·m_i = B, each GPU's
compute memory within its budget, and Σ compute memory + training state within the total.

The paper's DP is O(N·B³·log B). This search is exact for the same model and much faster:

1. Every achievable bottleneck is one of the finitely many values T_g(ℓ, m); binary-search
   the smallest threshold T at which the batch B is *reachable* — each GPU picks some b_i
   whose best configuration finishes within T — ignoring the aggregate memory constraint.
   Reachability is a boolean subset-sum over GPU classes (identical GPUs share one table),
   computed as sumset powers with FFT convolution: O(C·log N·B·log B) per probe.
2. If the assignment found there also satisfies the aggregate memory constraint, it is
   optimal (its threshold is a lower bound of the constrained optimum). Otherwise continue
   the binary search above that threshold with an exact min-plus subset sum that minimises
   total compute memory, which decides the constraint exactly.

Identical GPUs are combined by repeated squaring; a backtrack through the squaring tree
recovers one b per GPU, splitting batches in proportion to speed where the choice is free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

INF = float("inf")


@dataclass
class ClassTable:
    """All configurations one GPU class may run: parallel arrays over candidates."""

    batch: np.ndarray  # b = ℓ·m (0 for state only)
    ell: np.ndarray
    micro: np.ndarray
    seconds: np.ndarray
    memory_bytes: np.ndarray
    count: int  # GPUs in this class
    speed_weight: float  # relative samples/s, only to split batches where the choice is free


@dataclass
class _Node:
    array: np.ndarray
    weight: float
    left: _Node | None = None
    right: _Node | None = None
    leaf_class: int = -1


Combine = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _bool_sumset(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = x.size
    if n <= 512:
        return np.convolve(x.astype(np.int64), y.astype(np.int64))[:n] > 0
    size = 1 << (2 * n - 1).bit_length()
    prod = np.fft.irfft(np.fft.rfft(x.astype(np.float64), size) *
                        np.fft.rfft(y.astype(np.float64), size), size)
    return prod[:n] > 0.5


# The (rows x B) block `_minplus` reduces at once. A fixed row count (it was 256) made the
# block grow with B: 2 GiB at B = 10^6. A byte budget keeps it constant; the rows stay many
# enough (B <= 65536: >= 32 rows) for numpy to amortise its per-call overhead.
MINPLUS_BLOCK_BYTES = 16 * 1024**2


def _minplus(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """out[s] = min_i x[i] + y[s-i], truncated to len(x); rows in chunks to bound memory."""
    n = x.size
    padded = np.concatenate([np.full(n, INF), y])
    # windows[k, t] = padded[k + t]; row i of `shifted` holds y[s - i] at column s.
    windows = np.lib.stride_tricks.sliding_window_view(padded, n)
    out = np.full(n, INF)
    finite = np.flatnonzero(np.isfinite(x))
    chunk = max(1, MINPLUS_BLOCK_BYTES // (n * padded.itemsize))
    for start in range(0, finite.size, chunk):
        rows = finite[start:start + chunk]
        block = x[rows, None] + windows[n - rows]
        np.minimum(out, block.min(axis=0), out=out)
    return out


def _power_tree(base: _Node, count: int, combine: Combine) -> _Node:
    result: _Node | None = None
    square = base
    while True:
        if count & 1:
            result = square if result is None else _Node(
                combine(result.array, square.array), result.weight + square.weight,
                result, square)
        count >>= 1
        if not count:
            break
        square = _Node(combine(square.array, square.array), 2 * square.weight, square, square)
    assert result is not None
    return result


def _build(leaves: list[np.ndarray], tables: list[ClassTable], combine: Combine) -> _Node:
    total: _Node | None = None
    for c, (leaf, table) in enumerate(zip(leaves, tables, strict=True)):
        node = _power_tree(_Node(leaf, table.speed_weight, leaf_class=c), table.count, combine)
        total = node if total is None else _Node(
            combine(total.array, node.array), total.weight + node.weight, total, node)
    assert total is not None
    return total


def _backtrack(node: _Node, target: int, minplus: bool, out: list[list[int]]) -> None:
    if node.left is None or node.right is None:
        out[node.leaf_class].append(target)
        return
    a, b = node.left.array[: target + 1], node.right.array[target::-1]
    share = target * node.left.weight / (node.left.weight + node.right.weight)
    balance = np.abs(np.arange(target + 1) - share)
    if minplus:
        cost = a + b
        best = cost.min()
        candidates = np.flatnonzero(cost <= best)
    else:
        candidates = np.flatnonzero(a & b)
    assert candidates.size, "backtrack reached an unreachable target"
    left = int(candidates[np.argmin(balance[candidates])])
    _backtrack(node.left, left, minplus, out)
    _backtrack(node.right, target - left, minplus, out)


def _allowed(tables: list[ClassTable], threshold: float, size: int) -> list[np.ndarray]:
    """Per class: min compute memory for each batch b among configs within `threshold`."""
    out = []
    for t in tables:
        mem = np.full(size, INF)
        ok = t.seconds <= threshold
        np.minimum.at(mem, t.batch[ok], t.memory_bytes[ok])
        out.append(mem)
    return out


def _bool_reachable(tables: list[ClassTable], threshold: float, batch: int) -> bool:
    leaves = [np.isfinite(m) for m in _allowed(tables, threshold, batch + 1)]
    return bool(_build(leaves, tables, _bool_sumset).array[batch])


def _minplus_memory(tables: list[ClassTable], threshold: float, batch: int) -> float:
    leaves = _allowed(tables, threshold, batch + 1)
    return float(_build(leaves, tables, _minplus).array[batch])


def _assign(tables: list[ClassTable], threshold: float, batch: int,
            minplus: bool) -> list[list[int]]:
    leaves = _allowed(tables, threshold, batch + 1)
    if minplus:
        root = _build(leaves, tables, _minplus)
    else:
        root = _build([np.isfinite(m) for m in leaves], tables, _bool_sumset)
    per_class: list[list[int]] = [[] for _ in tables]
    _backtrack(root, batch, minplus, per_class)
    return [sorted(b, reverse=True) for b in per_class]


@dataclass
class SearchResult:
    threshold_seconds: float
    batches: list[list[int]]  # per class, one b per GPU (descending)
    memory_checked_exactly: bool


def min_bottleneck(tables: list[ClassTable], batch: int,
                   memory_room_bytes: float) -> SearchResult | None:
    """Smallest bottleneck threshold and one batch split achieving it, or None if no split
    of `batch` fits. `memory_room_bytes` bounds Σ compute memory (total budget − state)."""
    candidates = np.unique(np.concatenate([t.seconds for t in tables]))
    if candidates.size == 0 or not _bool_reachable(tables, candidates[-1], batch):
        return None
    lo, hi = 0, candidates.size - 1  # invariant: reachable at hi
    while lo < hi:
        mid = (lo + hi) // 2
        if _bool_reachable(tables, candidates[mid], batch):
            hi = mid
        else:
            lo = mid + 1
    threshold = float(candidates[lo])
    batches = _assign(tables, threshold, batch, minplus=False)
    if _split_memory(tables, threshold, batches) <= memory_room_bytes:
        return SearchResult(threshold, batches, memory_checked_exactly=False)
    # The aggregate memory constraint binds: continue with the exact min-plus check.
    if _minplus_memory(tables, candidates[-1], batch) > memory_room_bytes:
        return None
    hi = candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _minplus_memory(tables, candidates[mid], batch) <= memory_room_bytes:
            hi = mid
        else:
            lo = mid + 1
    threshold = float(candidates[lo])
    return SearchResult(threshold, _assign(tables, threshold, batch, minplus=True), True)


def _split_memory(tables: list[ClassTable], threshold: float,
                  batches: list[list[int]]) -> float:
    leaves = _allowed(tables, threshold, int(max(t.batch.max(initial=0) for t in tables)) + 1)
    return float(sum(leaves[c][b] for c, bs in enumerate(batches) for b in bs))
