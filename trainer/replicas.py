"""Hybrid sharding's plumbing (docs/hybrid-sharding.md): replica groups, their process
groups, and the state sharded across groups.

Under a plan's `replica_groups` (G groups of k ranks) the model is sharded unevenly inside
each group (the engine's uneven FSDP, run on the group's process group), and the ranks at
one position in every group all hold that position's slice, fp32. The optimizer state of a
slice is split once more, evenly, across them (ZeRO++-style secondary partitioning): the
rank in group g keeps the master and Adam moments of piece g only. A unit's gradient is
reduce-scattered inside the group (the slice's gradient, the group's sum), then across the
position's ranks (the piece's gradient, the world's sum); after the update each piece is
all-gathered back into the slice across them (`CrossGroupShards`). A plan's
`replicated_fraction` keeps the leading share of every slice out of that split: every rank
at the position keeps its whole state, its gradient is all-reduced across them under the
backward, and nothing of it is gathered after the update (the bytes of the parameters'
all-gather move from the next forward into the backward, at the price of that share's
optimizer state in every group). Nothing else crosses groups but the end-of-step
all-reduce (loss, norm, timings, votes), on the world.

The pure part (positions, group ratios) is separate from the part that makes process
groups, so the checks run without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cephalo.api.plan import check_replica_groups
from cephalo.api.sharding import replicated_prefix, shard_bounds
from cephalo.trainer.collectives import Pending, UnevenCollectives

__all__ = ["CrossGroupShards", "ReplicaGroups", "build_replica_groups", "check_groups",
           "file_bounds", "file_index", "file_ranges", "group_ratios", "locate", "master_ranges",
           "piece_bounds", "piece_index", "positions"]


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


def piece_bounds(slice_numel: int, groups: int) -> list[tuple[int, int]]:
    """A slice split evenly into one piece per replica group (group g owns piece g)."""
    return shard_bounds(slice_numel, [1.0 / groups] * groups)


def piece_index(groups: list[list[int]], rank: int) -> int:
    """The piece of its slice whose state `rank` owns: its rank in its position's process
    group, which torch numbers in the order of the global ranks (not of the groups)."""
    _, position = locate(groups, rank)
    return sorted(positions(groups)[position]).index(rank)


def file_ranges(slice_numel: int, groups: int, fraction: float = 0.0) -> list[tuple[int, int]]:
    """What each piece's checkpoint file holds of a slice (slice offsets, piece order): the
    pieces of the sharded part, the replicated prefix (`fraction`) in piece 0's, so the
    files cover the slice once and each holds one range."""
    head = replicated_prefix(slice_numel, fraction)
    pieces = [(head + a, head + b) for a, b in piece_bounds(slice_numel - head, groups)]
    pieces[0] = (0, pieces[0][1])
    return pieces


def master_ranges(slice_numel: int, groups: int, piece: int, fraction: float = 0.0
                  ) -> list[tuple[int, int]]:
    """The ranges of a slice (slice offsets) whose optimizer state the rank owning `piece`
    keeps, in the order its master concatenates them: the replicated prefix, then its piece
    of the rest (one range for piece 0, whose file holds both)."""
    head = replicated_prefix(slice_numel, fraction)
    a, b = piece_bounds(slice_numel - head, groups)[piece]
    if piece == 0 or head == 0:
        return [(0 if piece == 0 else head + a, head + b)]
    return [(0, head), (head + a, head + b)]


def file_index(position: int, piece: int, groups: int) -> int:
    """The checkpoint file of the rank at `position` that owns `piece`: position-major, so
    the files' pieces follow each other through every unit (flat: the rank)."""
    return position * groups + piece


def file_bounds(position_bounds: list[tuple[int, int]], groups: int, fraction: float = 0.0
                ) -> list[tuple[int, int]]:
    """A unit's global [start, end) of every file's piece (`file_index` order), from its
    slices' bounds by position (`file_ranges`)."""
    return [(start + a, start + b) for start, end in position_bounds
            for a, b in file_ranges(end - start, groups, fraction)]


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's place in the replica groups and the two process groups it uses."""

    groups: list[list[int]]
    index: int  # the group this rank is in
    position: int  # its place there: the slice it holds
    shard_group: dist.ProcessGroup  # its group's ranks: gathers and reduce-scatters
    cross_group: dist.ProcessGroup  # the ranks at its position: the pieces' collectives


def build_replica_groups(groups: list[list[int]], rank: int) -> ReplicaGroups:
    """The process groups of `groups` (global ranks of the default group). A collective
    over the default group: every rank creates every subgroup, in the same order (all the
    groups, then all the positions), as torch.distributed requires of `new_group`; each
    keeps the two it belongs to."""
    index, position = locate(groups, rank)
    shard_group, _ = dist.new_subgroups_by_enumeration(groups)
    cross_group, _ = dist.new_subgroups_by_enumeration(positions(groups))
    return ReplicaGroups(groups, index, position, shard_group, cross_group)


class CrossGroupShards:
    """The state one rank keeps across replica groups, and the collectives that keep it.

    The rank at position j of group g holds the whole fp32 slice j of every unit (`slices`:
    what its group's all-gathers read). Each slice is cut in two: a replicated prefix (the
    plan's `replicated_fraction` of it, `heads`) and the rest, split evenly in G pieces
    (`bounds`, in the rest's offsets). The rank keeps the master of the prefix and of piece
    g of the rest (`master_ranges`), so the optimizer state of the rest is split G ways
    more. Per step:

    * backward: the engine hands over each unit's intra-group reduce-scatter as it issues
      it (`follow`); the cross-group collectives of the previous one's slice gradient (over
      this position's ranks, one per group) start then, once that reduce-scatter is done,
      so they run under the next unit's backward: an all-reduce of the prefix and a
      reduce-scatter of the rest. `finish` starts the last ones and waits for all: every
      master's gradient summed over the world, before the optimizer;
    * after the update: `publish` copies each updated prefix into its slice (every rank at
      the position computed the same one) and starts the cross-group all-gather of every
      unit's piece into the rest, unit 0 first; `slice(u)` waits unit u's just before its
      group gathers it, so each hides under the forward of the units before it.

    All start in an order every rank shares (the reduce-scatters', whatever a rank's batch
    or kept blocks; units 0.. for the gathers): order, not timing, decides."""

    def __init__(self, comm: UnevenCollectives, slices: list[torch.Tensor], index: int,
                 groups: int, reduce_dtype: torch.dtype | None,
                 gather_dtype: torch.dtype | None, replicated_fraction: float = 0.0) -> None:
        self.comm = comm  # the ranks at this rank's position (one per group)
        self.slices = slices  # by unit; a finished all-gather fills its rest
        self.index = index  # the piece of each slice this rank owns (piece_index)
        self.groups = groups
        self.fraction = replicated_fraction
        self.heads = [replicated_prefix(s.numel(), replicated_fraction) for s in slices]
        self.bounds = [piece_bounds(s.numel() - h, groups)
                       for s, h in zip(slices, self.heads, strict=True)]
        self.reduce_dtype = reduce_dtype  # the job's reducePrecision (None: fp32)
        # gatherPrecision (None: fp32, exact). bf16 loses nothing a group computes with:
        # its own all-gather rounds the slice to bf16 anyway.
        self.gather_dtype = gather_dtype
        self._previous: tuple[int, Pending] | None = None
        self._reduced: dict[int, tuple[Pending | None, Pending | None]] = {}
        self._gathers: dict[int, Pending] = {}

    def master_ranges(self, unit: int) -> list[tuple[int, int]]:
        """The ranges of unit `unit`'s slice (its own offsets) this rank's master holds."""
        return master_ranges(self.slices[unit].numel(), self.groups, self.index, self.fraction)

    def masters(self) -> list[torch.Tensor]:
        """This rank's masters, copied from the slices (their first values)."""
        return [self.master_of(u, s) for u, s in enumerate(self.slices)]

    def master_of(self, unit: int, values: torch.Tensor) -> torch.Tensor:
        """The part of a slice-sized tensor (`values`: the slice, its decay mask) that
        this rank's master of unit `unit` holds, as one new tensor."""
        return torch.cat([values[a:b] for a, b in self.master_ranges(unit)])

    def unshared(self, unit: int, master: torch.Tensor) -> torch.Tensor:
        """The part of a master-sized tensor (the master, its gradient) this rank alone
        holds at its position: its piece, without the prefix every group holds (what it
        counts in the world's squared norm, so each element counts once, and what its
        checkpoint file holds unless it owns piece 0, whose file holds the prefix too)."""
        return master if self.index == 0 else master[self.heads[unit]:]

    # ---- backward: the slice gradients, summed across the groups ------------------------
    def begin(self) -> None:
        """Forget the last step's reductions (all waited for by then)."""
        self._previous = None
        self._reduced = {}

    def follow(self, unit: int, scatter: Pending) -> Pending:
        """Unit `unit`'s intra-group reduce-scatter has just been issued: start the
        cross-group ones of the unit before it. Returns `scatter` for the pass to wait on."""
        self._start_previous()
        self._previous = (unit, scatter)
        return scatter

    def finish(self, units: int) -> list[torch.Tensor]:
        """Every master's gradient summed over the world, by unit (0..units-1)."""
        self._start_previous()
        missing = [u for u in range(units) if u not in self._reduced]
        if missing:
            raise RuntimeError(f"units {missing} were never reduce-scattered this step")
        out = []
        for u in range(units):
            prefix, piece = self._reduced[u]
            parts = [p.wait() for p in (prefix, piece) if p is not None]
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return out

    def _start_previous(self) -> None:
        if self._previous is None:
            return
        unit, scatter = self._previous
        self._previous = None
        grad, head = scatter.wait(), self.heads[unit]
        # The two ride the same position's ranks, in the same order on every rank: the
        # prefix's all-reduce first, then the rest's reduce-scatter. An empty part issues
        # nothing (every rank at the position holds the same slice: all skip it alike).
        prefix = self.comm.all_reduce(grad[:head], unit, wire_dtype=self.reduce_dtype) \
            if head else None
        rest = self.comm.reduce_scatter(grad[head:] if head else grad, self.bounds[unit],
                                        unit, wire_dtype=self.reduce_dtype) \
            if head < grad.numel() or not head else None
        self._reduced[unit] = (prefix, rest)

    # ---- after the update: the pieces, all-gathered into the slices --------------------
    def publish(self, masters: list[torch.Tensor]) -> None:
        """Copy every updated prefix into its slice and start the all-gather of every
        unit's updated piece into the rest of it, unit 0 first."""
        if self._gathers:
            raise RuntimeError(f"units {sorted(self._gathers)} still gather the last update")
        for unit, master in enumerate(masters):
            head = self.heads[unit]
            if head:
                self.slices[unit][:head].copy_(master[:head])
            if head < self.slices[unit].numel() or not head:
                self._gathers[unit] = self.comm.all_gather(master[head:], self.bounds[unit],
                                                           unit, wire_dtype=self.gather_dtype)

    def slice(self, unit: int) -> torch.Tensor:
        """Unit `unit`'s slice, as of the last update (waits for its all-gather)."""
        pending = self._gathers.pop(unit, None)
        if pending is not None:
            if self.heads[unit]:
                self.slices[unit][self.heads[unit]:].copy_(pending.wait())
            else:
                self.slices[unit] = pending.wait()
        return self.slices[unit]

    def exact_slice(self, unit: int, master: torch.Tensor) -> torch.Tensor:
        """Unit `unit`'s slice in fp32 from the masters (a collective over the position):
        under a bf16 `gather_dtype` the slices' rest is rounded, so it is gathered again."""
        head = self.heads[unit]
        if head and head == master.numel():
            return master.clone()  # all of it replicated: the master is the slice
        rest = self.comm.all_gather(master[head:], self.bounds[unit], unit).wait()
        return torch.cat([master[:head], rest]) if head else rest

    def settle(self) -> None:
        """Wait for every outstanding all-gather (before anything reads all the slices)."""
        for unit in sorted(self._gathers):
            self.slice(unit)

    @property
    def outstanding(self) -> list[int]:
        """The units whose all-gather is not waited for yet."""
        return sorted(self._gathers)
