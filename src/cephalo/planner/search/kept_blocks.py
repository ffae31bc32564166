"""Kept blocks in recompute mode (a rank plan's `kept_blocks`): which counts to offer the
search for each (ℓ, m) candidate.

A rank that recomputes may keep the autograd graphs of its last k blocks instead
(cephalo.api.memory.kept_blocks_bytes): each kept block saves its recompute (b - f instead
of b per microbatch) and costs one block graph for all the rank's ℓ·m samples. The choice is
per rank (collectives do not change), so it is one more dimension of each rank's candidates:
(ℓ, m, k) with k = 0 .. kmax(ℓ, m), kmax the most blocks that fit the class's room next to
the compute memory. The step time falls and the memory grows with k, so the search's least
memory within a threshold takes the least k that is fast enough, and the solver's last pass
spends memory left over on more kept blocks.

Where nothing fits (big models: one block graph for a rank's samples is gigabytes) no
candidate is added and nothing slows down. Where the full range would add more than
KEPT_CANDIDATES_MAX candidates to a class, only k in {ceil(kmax / 2), kmax} are offered
and the plan's search info says so (the search is then exact over those candidates only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cephalo.planner.cost.comm_model import UnitComm
from cephalo.planner.cost.costmodel import GpuCostModel

# Kept candidates per class beyond which only {ceil(kmax / 2), kmax} are offered: keeps the
# search's per-threshold work (O(candidates)) within the large cases' targets.
KEPT_CANDIDATES_MAX = 400_000


@dataclass
class KeptCandidates:
    index: np.ndarray  # per kept candidate: the (ℓ, m) candidate it extends
    kept: np.ndarray  # its kept block count (≥ 1)
    seconds: np.ndarray
    memory_bytes: np.ndarray
    subset: bool  # True: only {ceil(kmax / 2), kmax} per (ℓ, m)


def kept_candidates(cost: GpuCostModel, micro: np.ndarray, ell: np.ndarray,
                    base_seconds: np.ndarray, room_bytes: float, comm: UnitComm,
                    limit: int | None = None) -> KeptCandidates:
    """The (ℓ, m, k ≥ 1) candidates of one class that fit `room_bytes`, without those no
    faster than the next fewer kept blocks of the same (ℓ, m) (as fast, more memory: never
    chosen). `base_seconds` are the candidates' times with k = 0."""
    limit = KEPT_CANDIDATES_MAX if limit is None else limit
    most = cost.max_kept_blocks(micro, ell, room_bytes)
    # A step never gets slower with more kept blocks: where keeping all kmax is no faster
    # than none (collectives hide the recompute), no count is, and none is offered.
    some = np.flatnonzero(most)
    if some.size:
        useful = cost.step_seconds(ell[some], micro[some], comm, most[some]) < \
            base_seconds[some]
        most[some[~useful]] = 0
    total = int(most.sum())
    subset = total > limit
    if subset:
        half = (most + 1) // 2
        counts = (most > 0).astype(np.int64) + (most > 1)
        index = np.repeat(np.arange(most.size), counts)
        first = np.ones(index.size, dtype=bool)
        first[1:] = index[1:] != index[:-1]
        kept = np.where(first, half[index], most[index])
    else:
        index = np.repeat(np.arange(most.size), most)
        starts = np.repeat(np.cumsum(most) - most, most)
        kept = np.arange(index.size) - starts + 1
    kept = kept.astype(np.int64)
    seconds = cost.step_seconds(ell[index], micro[index], comm, kept)
    # Each against its predecessor: fewer kept blocks of the same (ℓ, m), or k = 0.
    previous = base_seconds[index]
    same = np.zeros(index.size, dtype=bool)
    same[1:] = index[1:] == index[:-1]
    previous[1:] = np.where(same[1:], seconds[:-1], previous[1:])
    faster = seconds < previous
    index, kept, seconds = index[faster], kept[faster], seconds[faster]
    memory_bytes = cost.compute_memory_bytes(micro[index], ell[index], kept)
    return KeptCandidates(index, kept, seconds, memory_bytes, subset and total > 0)

