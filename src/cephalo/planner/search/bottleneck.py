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
   Two O(C·B) tests bracket the search first (`_reach_bounds`): below the first threshold
   where the classes' largest batches add up to B nothing is reachable; from the first
   where their contiguous batch ranges hold B everything is. Only the thresholds in between
   need sumsets.
2. If the assignment found there also satisfies the aggregate memory constraint, it is
   optimal (its threshold is a lower bound of the constrained optimum). Otherwise continue
   the binary search above that threshold with an exact min-plus subset sum that minimises
   total compute memory, which decides the constraint exactly — O(B²) per combine, so only
   up to EXACT_MINPLUS_MAX_BATCH. Above it, `lagrange.py` decides each threshold in O(C·B):
   a Lagrangian bound proves thresholds infeasible, a constructed split proves them
   feasible; the plan's threshold is the least proven feasible, and the least not proven
   infeasible is a proven lower bound. A gap between them is closed with the exact min-plus
   when that is affordable (EXACT_CLOSE_MAX_OPS), else stated in the plan.

Identical GPUs are combined by repeated squaring; a backtrack through the squaring tree
recovers one b per GPU, splitting batches in proportion to speed where the choice is free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cephalo.planner.search import lagrange

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
    # Recompute mode: blocks whose graphs each candidate keeps (None: none anywhere).
    kept: np.ndarray | None = None
    kept_subset: bool = False  # only some kept counts offered (kept_blocks.py)

    def kept_at(self, index: int) -> int:
        return 0 if self.kept is None else int(self.kept[index])


@dataclass
class _Node:
    array: np.ndarray
    weight: float
    left: _Node | None = None
    right: _Node | None = None
    leaf_class: int = -1


Combine = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _fft_size(length: int) -> int:
    """The least 2^k, 3·2^k or 5·2^k ≥ length: pocketfft is fast on those, and the plain
    power of two can be nearly twice as long."""
    best = 1 << (length - 1).bit_length()
    for odd in (3, 5):
        size = odd << max(0, (length - 1) // odd).bit_length()
        while size // 2 >= length and size % (2 * odd) == 0:
            size //= 2
        if size >= length:
            best = min(best, size)
    return best


def _bool_sumset(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = x.size
    if n <= 512:
        return np.convolve(x.astype(np.int64), y.astype(np.int64))[:n] > 0
    # Linear convolution up to index n-1 needs a circular length of at least 2n - 1.
    size = _fft_size(2 * n - 1)
    fx = np.fft.rfft(x.astype(np.float64), size)
    fy = fx if y is x else np.fft.rfft(y.astype(np.float64), size)  # squaring: one FFT
    prod = np.fft.irfft(fx * fy, size)
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
    # A proven lower bound of the optimum: equal to the threshold when the search is exact.
    lower_bound_seconds: float = 0.0

    @property
    def gap_seconds(self) -> float:
        return max(0.0, self.threshold_seconds - self.lower_bound_seconds)


# Above this global batch the aggregate-memory phase uses the Lagrangian bound and a
# constructed split (lagrange.py, O(C·B) per threshold) instead of the exact O(B²) min-plus.
# Below it the exact min-plus costs well under a second; the oracle tests live there.
EXACT_MINPLUS_MAX_BATCH = 2048


def min_bottleneck(tables: list[ClassTable], batch: int,
                   memory_room_bytes: float) -> SearchResult | None:
    """Smallest bottleneck threshold and one batch split achieving it, or None if no split
    of `batch` fits. `memory_room_bytes` bounds Σ compute memory (total budget − state)."""
    candidates = np.unique(np.concatenate([t.seconds for t in tables]))
    if candidates.size == 0 or not _bool_reachable(tables, candidates[-1], batch):
        return None
    # Bracket with two cheap tests before the FFT search: below `lo` B is out of reach (the
    # largest batches do not add up), at `hi` it is surely reachable (contiguous ranges of
    # batches from 0 or 1 add up to a range holding B).
    lo = _first_true(candidates, 0, candidates.size - 1,
                     lambda t: _reach_bounds(tables, t, batch)[0])
    hi = _first_true(candidates, lo, candidates.size - 1,
                     lambda t: _reach_bounds(tables, t, batch)[1])
    while lo < hi:  # invariant: reachable at hi
        mid = (lo + hi) // 2
        if _bool_reachable(tables, candidates[mid], batch):
            hi = mid
        else:
            lo = mid + 1
    threshold = float(candidates[lo])
    batches = _assign(tables, threshold, batch, minplus=False)
    if _split_memory(tables, threshold, batches) <= memory_room_bytes:
        return SearchResult(threshold, batches, False, threshold)
    # The aggregate memory constraint binds.
    if batch > EXACT_MINPLUS_MAX_BATCH:
        return _bounded_memory_search(tables, batch, memory_room_bytes, candidates, lo)
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
    return SearchResult(threshold, _assign(tables, threshold, batch, minplus=True), True,
                        threshold)


def _lagrange_probe(tables: list[ClassTable], threshold: float, batch: int, room: float
                    ) -> tuple[bool, list[list[int]] | None]:
    """(proven infeasible, a split that fits or None) at one threshold."""
    leaves = _allowed(tables, threshold, batch + 1)
    counts = [t.count for t in tables]
    bound, lam_lo, lam_hi = lagrange.lagrangian(leaves, counts, batch)
    if bound > room + abs(room) * 1e-12:
        return True, None
    found = lagrange.primal(leaves, counts, batch, lam_lo, lam_hi)
    if found is None or found[0] > room:
        return False, None
    return False, found[1]


def _first_true(candidates: np.ndarray, lo: int, hi: int,
                test: Callable[[float], bool]) -> int:
    """Least index in [lo, hi] where the monotone `test` holds (hi if only there)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if test(float(candidates[mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _reach_bounds(tables: list[ClassTable], threshold: float, batch: int) -> tuple[bool, bool]:
    """(B may be reachable, B is surely reachable) at `threshold`, without a sumset.

    Necessary: Σ count · (largest batch in time) ≥ B. Sufficient: every batch in [low, c]
    is in time for each class (low 0 or 1, c as large as it goes), so k such GPUs reach every
    sum in [k·low, k·c], and the classes together every sum in [Σ k·low, Σ k·c]."""
    most = least = contiguous = 0
    runs = True  # every class has a run of batches from 0 or 1 in time
    for t in tables:
        ok = t.batch[t.seconds <= threshold]
        if ok.size == 0:
            return False, False
        most += t.count * int(ok.max())
        present = np.zeros(int(ok.max()) + 2, dtype=bool)
        present[ok] = True
        low = 0 if present[0] else 1
        if not present[low]:
            # No run from 0 or 1 (a fused-tail class whose smallest batch is several
            # microbatches): nothing is sure, but the necessary test still needs every
            # class's largest batch (returning here once undercounted it, and the search
            # skipped the optimum: seed 1013 of the planner oracle).
            runs = False
            continue
        run_end = low + int(np.argmin(present[low:])) - 1  # last of the run from `low`
        least += t.count * low
        contiguous += t.count * run_end
    return most >= batch, runs and least <= batch <= contiguous


def _bounded_memory_search(tables: list[ClassTable], batch: int, room: float,
                           candidates: np.ndarray, start: int) -> SearchResult | None:
    """The memory-binding search for large B: the least threshold with a constructed split
    that fits, and the least threshold the Lagrangian bound does not rule out (the proven
    lower bound). Both predicates only improve as the threshold grows."""
    top = candidates.size - 1
    infeasible, split = _lagrange_probe(tables, float(candidates[top]), batch, room)
    if infeasible:
        return None
    if split is None:  # neither proven: decide the loosest threshold exactly
        if _minplus_memory(tables, float(candidates[top]), batch) > room:
            return None
        threshold = float(candidates[top])
        return SearchResult(threshold, _assign(tables, threshold, batch, minplus=True), True,
                            float(candidates[start]))
    lo, hi, best = start, top, split
    while lo < hi:  # least threshold with a split that fits
        mid = (lo + hi) // 2
        _, found = _lagrange_probe(tables, float(candidates[mid]), batch, room)
        if found is not None:
            hi, best = mid, found
        else:
            lo = mid + 1
    upper = hi
    lo, hi = start, upper
    while lo < hi:  # least threshold not proven infeasible
        mid = (lo + hi) // 2
        if _lagrange_probe(tables, float(candidates[mid]), batch, room)[0]:
            lo = mid + 1
        else:
            hi = mid
    if lo < upper and _minplus_ops(tables, batch) <= EXACT_CLOSE_MAX_OPS:
        # A gap, and the exact check is affordable: close it between the two thresholds.
        hi = upper
        while lo < hi:
            mid = (lo + hi) // 2
            if _minplus_memory(tables, float(candidates[mid]), batch) <= room:
                hi = mid
            else:
                lo = mid + 1
        if hi < upper:
            threshold = float(candidates[hi])
            return SearchResult(threshold, _assign(tables, threshold, batch, minplus=True),
                                True, threshold)
        lo = upper
    return SearchResult(float(candidates[upper]), best, True, float(candidates[lo]))


# The Lagrangian search closes a gap with the exact min-plus when one pass of it costs at
# most this many element operations (~1 s of numpy).
EXACT_CLOSE_MAX_OPS = 4e8


def _minplus_ops(tables: list[ClassTable], batch: int) -> float:
    """Element operations of one exact min-plus pass: (B+1)² per combine."""
    combines = sum(t.count.bit_length() + bin(t.count).count("1") for t in tables)
    return float(combines) * (batch + 1) ** 2


def _split_memory(tables: list[ClassTable], threshold: float,
                  batches: list[list[int]]) -> float:
    leaves = _allowed(tables, threshold, int(max(t.batch.max(initial=0) for t in tables)) + 1)
    return float(sum(leaves[c][b] for c, bs in enumerate(batches) for b in bs))
