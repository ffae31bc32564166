"""Hybrid sharding's plumbing (docs/hybrid-sharding.md): replica groups, their process
groups, and the cross-group sum of the gradient shards.

Under a plan's `replica_groups` every group holds the whole training state, sharded unevenly
among its own ranks (the engine's uneven FSDP, run on the group's process group), and the
ranks at one position in every group hold the same slice. After a unit's reduce-scatter
inside the group, each rank's gradient shard holds its group's sum; one all-reduce among the
ranks of its position (one rank per group) makes it the job's sum. Nothing else crosses
groups but the end-of-step all-reduce (loss, norm, timings, votes), which runs on the world.

The pure part (positions, group ratios) is separate from the part that makes process
groups, so the checks run without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cephalo.api.plan import check_replica_groups
from cephalo.trainer.collectives import Pending, UnevenCollectives

__all__ = ["GradientSync", "ReplicaGroups", "build_replica_groups", "check_groups",
           "group_ratios", "locate", "positions"]


def check_groups(groups: list[list[int]], ratios: list[float], what: str) -> None:
    """`groups` partition the world (one ratio per rank in `ratios`) into groups of one
    size whose ratios sum to 1 and agree position by position; ValueError otherwise (the
    Plan's own check, cephalo.api.plan, so the trainer and the plan agree on the rules)."""
    try:
        check_replica_groups(groups, ratios, what)
    except ValueError as err:  # PlanError is a ValueError
        raise ValueError(str(err)) from None


def locate(groups: list[list[int]], rank: int) -> tuple[int, int]:
    """(index of the group `rank` belongs to, its position in that group)."""
    for index, group in enumerate(groups):
        if rank in group:
            return index, group.index(rank)
    raise ValueError(f"rank {rank} is in no replica group of {groups}")


def positions(groups: list[list[int]]) -> list[list[int]]:
    """The cross-group sets: for every position, the rank at it in every group."""
    return [[group[p] for group in groups] for p in range(len(groups[0]))]


def group_ratios(groups: list[list[int]], ratios: list[float]) -> list[float]:
    """The shard ratios within a group, by position. Group 0's, for every group: the groups'
    agree within the plan's tolerance, and rounding the bounds from one vector guarantees
    that every group cuts its units at the same offsets."""
    return [ratios[r] for r in groups[0]]


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's place in the replica groups and the two process groups it uses."""

    groups: list[list[int]]
    index: int  # the group this rank is in
    position: int  # its place there: the slice it holds
    shard_group: dist.ProcessGroup  # its group's ranks: gathers and reduce-scatters
    cross_group: dist.ProcessGroup  # the ranks at its position: the gradient all-reduce


def build_replica_groups(groups: list[list[int]], rank: int) -> ReplicaGroups:
    """The process groups of `groups` (global ranks of the default group). A collective
    over the default group: every rank creates every subgroup, in the same order (all the
    groups, then all the positions), as torch.distributed requires of `new_group`; each
    keeps the two it belongs to."""
    index, position = locate(groups, rank)
    shard_group, _ = dist.new_subgroups_by_enumeration(groups)
    cross_group, _ = dist.new_subgroups_by_enumeration(positions(groups))
    return ReplicaGroups(groups, index, position, shard_group, cross_group)


class GradientSync:
    """Sums every unit's gradient shard over the replica groups, overlapped with backward.

    The engine hands over each reduce-scatter as it issues it (`follow`); the all-reduce of
    the previous one's shard starts then, once that reduce-scatter is done, so it runs under
    the next unit's backward as the reduce-scatters themselves do. The all-reduces start in
    the order the reduce-scatters did, which is the same on every rank whatever its batch
    or kept blocks: that order, not timing, decides when each starts, so every position's
    group sees them in the same sequence. `finish` starts the last one and waits for all,
    before the optimizer."""

    def __init__(self, comm: UnevenCollectives, wire_dtype: torch.dtype | None) -> None:
        self.comm = comm  # the cross-group collectives (this rank's position)
        self.wire_dtype = wire_dtype  # the job's reducePrecision (None: fp32)
        self._previous: tuple[int, Pending] | None = None
        self._reduced: dict[int, Pending] = {}

    def begin(self) -> None:
        """Forget the last step's collectives (all waited for by then)."""
        self._previous = None
        self._reduced = {}

    def follow(self, unit: int, scatter: Pending) -> Pending:
        """Unit `unit`'s reduce-scatter has just been issued: start the cross-group sum of
        the one before it. Returns `scatter` for the pass to wait on as usual."""
        self._start_previous()
        self._previous = (unit, scatter)
        return scatter

    def finish(self, units: int) -> list[torch.Tensor]:
        """Every unit's gradient shard summed over the groups, by unit (0..units-1)."""
        self._start_previous()
        missing = [u for u in range(units) if u not in self._reduced]
        if missing:
            raise RuntimeError(f"units {missing} were never reduce-scattered this step")
        return [self._reduced[u].wait() for u in range(units)]

    def _start_previous(self) -> None:
        if self._previous is None:
            return
        unit, scatter = self._previous
        self._previous = None
        self._reduced[unit] = self.comm.all_reduce(scatter.wait(), unit,
                                                   wire_dtype=self.wire_dtype)
