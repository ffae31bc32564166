"""The aggregate-memory check for large global batches, in O(C·B) instead of O(B²).

At a time threshold every GPU class c has a leaf `mem_c[b]`: the least compute memory of a
configuration of batch b that finishes in time (inf where none does). The exact question —
is min Σ_i mem_{c(i)}[b_i] over Σ_i b_i = B within the room? — is a min-plus subset sum,
O(B²) per combine. Its Lagrangian relaxation drops Σ b_i = B for a price λ per sample:

    g(λ) = λ·B + Σ_c k_c · min_b (mem_c[b] − λ·b)

is a lower bound of the exact minimum for every λ (weak duality), so g(λ) > room *proves*
the threshold infeasible. A primal split is built from the two sides of the best λ: every
GPU starts at its class's minimiser below B, GPUs move to the minimiser above while the sum
stays ≤ B, and a small exact min-plus over a few GPUs (two per class) absorbs the rest. Its
memory is an upper bound; when it fits the room, the threshold is *proven* feasible. The
search keeps both: the plan's threshold (feasible) and the largest threshold proven
infeasible, whose distance is the stated optimality gap (zero in every case measured).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INF = float("inf")
# Bisection steps on λ: the breakpoints are memory differences over batch differences
# (bytes per sample); 200 halvings of a range of ~1e12 reach far below one byte.
_BISECTION_STEPS = 200
# GPUs per class left free for the final exact repair.
_FREE_PER_CLASS = 2
# Samples each free GPU may move beyond its even part of the deficit.
_WINDOW_SLACK = 32


def _argmin_batches(leaves: Sequence[np.ndarray], lam: float,
                    largest: bool) -> list[int]:
    """Per class, the b minimising mem[b] − λ·b (ties: smallest b, or largest)."""
    out = []
    for leaf in leaves:
        value = leaf - lam * np.arange(leaf.size)
        if largest:
            out.append(int(leaf.size - 1 - np.argmin(value[::-1])))
        else:
            out.append(int(np.argmin(value)))
    return out


def _dual(leaves: Sequence[np.ndarray], counts: Sequence[int], batch: int,
          lam: float) -> float:
    return lam * batch + sum(k * float(np.min(leaf - lam * np.arange(leaf.size)))
                             for leaf, k in zip(leaves, counts, strict=True))


def lagrangian(leaves: Sequence[np.ndarray], counts: Sequence[int],
               batch: int) -> tuple[float, float, float]:
    """(lower bound of the min-plus optimum, λ with Σ b*(λ) ≤ B, λ with Σ b*(λ) ≥ B).

    Σ_i b*_i(λ) (ties to the smallest b) grows with λ; bisect for the λ where it crosses B.
    """
    finite = [leaf[np.isfinite(leaf)] for leaf in leaves]
    spread = max((float(np.ptp(f)) if f.size else 0.0) for f in finite) + 1.0
    lo, hi = -2.0 * spread, 2.0 * spread  # beyond every breakpoint slope
    total = sum(k * b for k, b in zip(counts, _argmin_batches(leaves, lo, False), strict=True))
    if total > batch:  # even the most negative price overshoots: no split reaches B
        return INF, lo, lo
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        total = sum(k * b for k, b in zip(counts, _argmin_batches(leaves, mid, False),
                                          strict=True))
        if total <= batch:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * max(1.0, abs(lo)):
            break
    bound = max(_dual(leaves, counts, batch, lo), _dual(leaves, counts, batch, hi))
    return bound, lo, hi


def primal(leaves: Sequence[np.ndarray], counts: Sequence[int], batch: int, lam_lo: float,
           lam_hi: float) -> tuple[float, list[list[int]]] | None:
    """A split of `batch` (per class, one b per GPU) and its total memory, or None."""
    low = _argmin_batches(leaves, lam_lo, largest=False)
    high = _argmin_batches(leaves, lam_hi, largest=True)
    per_class = [[low[c]] * counts[c] for c in range(len(leaves))]
    total = sum(k * b for k, b in zip(counts, low, strict=True))
    if total > batch:
        return None
    for c in range(len(leaves)):
        step = high[c] - low[c]
        if step <= 0:
            continue
        moves = min(counts[c], (batch - total) // step)
        for i in range(moves):
            per_class[c][i] = high[c]
        total += moves * step
    total = _greedy_fill(leaves, per_class, batch - total, lam_lo)
    # The deficit goes to a few free GPUs, solved exactly: up to two per class (one of each
    # configuration), each moving within a window of ±W samples around its current batch.
    free: list[tuple[int, int]] = []  # (class, index in per_class)
    for c, batches in enumerate(per_class):
        picks = sorted({0, len(batches) - 1}) if batches else []
        free += [(c, i) for i in picks[:_FREE_PER_CLASS]]
    deficit = total
    if not free:
        return None
    window = -(-deficit // len(free)) + _WINDOW_SLACK
    offsets = np.arange(-window, window + 1)
    arrays = []
    for c, i in free:
        at = per_class[c][i] + offsets
        inside = (at >= 0) & (at < leaves[c].size)
        arrays.append(np.where(inside, leaves[c][np.clip(at, 0, leaves[c].size - 1)], INF))
    prefix = [arrays[0]]
    for a in arrays[1:]:
        prefix.append(_minplus_full(prefix[-1], a))
    # prefix[j][s] is the least memory of free GPUs 0..j moving by s − (j+1)·window in all.
    want = deficit + len(free) * window
    if want >= prefix[-1].size or not np.isfinite(prefix[-1][want]):
        return None
    shift = []
    for j in range(len(free) - 1, 0, -1):
        # prefix[j][want] = min_t prefix[j-1][t] + arrays[j][want − t]
        t = np.arange(max(0, want - arrays[j].size + 1), min(want, prefix[j - 1].size - 1) + 1)
        best = int(t[np.argmin(prefix[j - 1][t] + arrays[j][want - t])])
        shift.append(want - best - window)
        want = best
    shift.append(want - window)
    for (c, i), delta in zip(free, reversed(shift), strict=True):
        per_class[c][i] += int(delta)
    assert sum(sum(bs) for bs in per_class) == batch
    memory = float(sum(float(leaves[c][b]) for c, bs in enumerate(per_class) for b in bs))
    if not np.isfinite(memory):
        return None
    return memory, [sorted(bs, reverse=True) for bs in per_class]


def _greedy_fill(leaves: Sequence[np.ndarray], per_class: list[list[int]], deficit: int,
                 lam: float) -> int:
    """Raise single GPUs' batches to absorb `deficit`, each time the move of least reduced
    cost (memory − λ·samples added); returns what is left (0 almost always)."""
    while deficit > 0:
        best: tuple[float, int, int, int] | None = None  # (reduced cost, class, gpu, new b)
        for c, batches in enumerate(per_class):
            for b in set(batches):
                leaf = leaves[c]
                seg = leaf[b + 1: b + deficit + 1]
                if seg.size == 0:
                    continue
                reduced = seg - leaf[b] - lam * np.arange(1, seg.size + 1)
                k = int(np.argmin(reduced))
                if np.isfinite(reduced[k]) and (best is None or reduced[k] < best[0]):
                    best = (float(reduced[k]), c, batches.index(b), b + 1 + k)
        if best is None:
            break
        _, c, i, new = best
        deficit -= new - per_class[c][i]
        per_class[c][i] = new
    return deficit


def _minplus_full(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """out[s] = min_i x[i] + y[s − i] over the full length (small windows only)."""
    out = np.full(x.size + y.size - 1, INF)
    for i in np.flatnonzero(np.isfinite(x)):
        np.minimum(out[i:i + y.size], x[i] + y, out=out[i:i + y.size])
    return out
