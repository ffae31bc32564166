"""How a unit's flat parameter buffer is split among ranks: pure integer arithmetic shared by
the trainer (which shards), the checkpoint format (which records global offsets) and the
planner (which predicts memory)."""

from __future__ import annotations

from collections.abc import Sequence


def shard_bounds(numel: int, ratios: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) element ranges, one per rank, sized by `ratios` (sum 1).

    Boundaries are rounded cumulative sums, so every element has exactly one owner, sizes
    differ from `ratio * numel` by less than one element, and a zero ratio owns nothing.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if any(r < 0 for r in ratios):
        raise ValueError(f"shard ratios must be >= 0, got {list(ratios)}")
    total = float(sum(ratios))
    if not ratios or total <= 0:
        raise ValueError(f"shard ratios must have a positive sum, got {list(ratios)}")
    bounds: list[tuple[int, int]] = []
    cumulative = 0.0
    start = 0
    for i, r in enumerate(ratios):
        cumulative += r
        end = numel if i == len(ratios) - 1 else min(numel, round(numel * cumulative / total))
        end = max(end, start)
        bounds.append((start, end))
        start = end
    return bounds


def is_even(bounds: Sequence[tuple[int, int]]) -> bool:
    """True when all shards have the same size, up to one element (no uneven-collective cost)."""
    sizes = [e - s for s, e in bounds]
    return max(sizes) - min(sizes) <= 1


def replicated_prefix(slice_numel: int, fraction: float) -> int:
    """How many leading elements of a rank's slice hybrid sharding replicates across groups
    (a plan's `replicated_fraction`, docs/hybrid-sharding.md): rounded, so every rank at one
    position, holding the same slice, agrees."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"replicated fraction must be in [0, 1], got {fraction}")
    return min(slice_numel, round(slice_numel * fraction))
