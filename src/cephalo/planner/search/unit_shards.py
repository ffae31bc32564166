"""Per-unit sharding (the paper's §4.3): some units sharded evenly, the others skewed.

An uneven collective costs up to 15 % more than an even one (measured: the profile's
`uneven_overhead`), so a plan should split only as many units unevenly as memory needs.
With per-rank memory left after compute, room[r] = budget[r] − compute[r], a set E of even
units (state bytes s_E) fits exactly when

    s_E / N ≤ min_r room[r]                (every rank holds 1/N of every even unit), and
    S ≤ Σ_r room[r]                        (the skewed units' S − s_E fills what is left:
                                            Σ_r (room[r] − s_E/N) = Σ room − s_E).

The second condition does not depend on E, so the choice of E is a knapsack with one
capacity, N · min room, over the units' state bytes. Units come in three kinds: embedding,
L identical blocks, head. Blocks of one model are interchangeable (same bytes, same
collectives), so every E is equivalent, for memory and for the cost model, to
(embedding even?, head even?, number of even blocks): 4 (L + 1) options cover all 2^(L+2)
subsets, and enumerating them is exact (tests check it against every subset). The even
blocks are the first ones (units 1..k).

All-even and all-skewed are two of the options, so a plan with per-unit choice is never
slower under the cost model than the better of them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from cephalo.api.memory import state_bytes_per_parameter
from cephalo.api.models import ModelConfig
from cephalo.planner.cost.comm_model import CommModel, UnitComm


@dataclass(frozen=True, order=True)
class EvenUnits:
    """Which units are sharded evenly (1/N each); the rest share one skewed ratio vector."""

    embedding: bool
    head: bool
    blocks: int  # the first `blocks` blocks (units 1..blocks)

    @classmethod
    def all(cls, num_layers: int) -> EvenUnits:
        return cls(True, True, num_layers)

    @classmethod
    def none(cls) -> EvenUnits:
        return cls(False, False, 0)

    def count(self) -> int:
        return int(self.embedding) + int(self.head) + self.blocks

    def is_all(self, num_layers: int) -> bool:
        return self == EvenUnits.all(num_layers)

    def unit_indices(self, num_layers: int) -> list[int]:
        """Engine unit indices (0 embedding, 1..L blocks, L + 1 head) sharded evenly."""
        head = [num_layers + 1] if self.head else []
        return ([0] if self.embedding else []) + list(range(1, self.blocks + 1)) + head

    def parameters(self, model: ModelConfig) -> int:
        return (model.embedding_parameters() * self.embedding +
                model.head_parameters() * self.head + model.block_parameters() * self.blocks)

    def covers(self, other: EvenUnits) -> bool:
        """Every unit even in `other` is even here."""
        return (self.embedding >= other.embedding and self.head >= other.head
                and self.blocks >= other.blocks)


def even_unit_options(num_layers: int) -> Iterator[EvenUnits]:
    """Every distinct even set, up to interchanging identical blocks: 4 (L + 1) of them."""
    for embedding in (False, True):
        for head in (False, True):
            for blocks in range(num_layers + 1):
                yield EvenUnits(embedding, head, blocks)


def even_state_bytes(model: ModelConfig, precision: str, even: EvenUnits) -> int:
    return state_bytes_per_parameter(precision) * even.parameters(model)


@functools.lru_cache(maxsize=4096)
def mixed_unit_comm(model: ModelConfig, comm: CommModel, world_size: int,
                    even: EvenUnits) -> UnitComm:
    """The collectives' seconds when the units in `even` are even and the rest uneven.
    All-even and all-uneven give exactly UnitComm.build's numbers. Kept by its immutable
    arguments (bounded): a search asks for the same even sets for every candidate."""
    if world_size <= 1 or even.is_all(model.num_layers):
        return UnitComm.build(model, comm, world_size, uneven=False)
    skewed = UnitComm.build(model, comm, world_size, uneven=True)
    if even == EvenUnits.none():
        return skewed
    flat = UnitComm.build(model, comm, world_size, uneven=False)

    def ring(params: int, uneven: bool) -> float:
        return comm.ring_seconds(params * comm.bytes_per_parameter("reduce_scatter"),
                                 world_size, uneven, "reduce_scatter")

    embedding, head = model.embedding_parameters(), model.head_parameters()
    return replace(
        skewed,
        ag_first=flat.ag_first if even.embedding else skewed.ag_first,
        ag_head=flat.ag_head if even.head else skewed.ag_head,
        rs_other=ring(embedding, not even.embedding) + ring(head, not even.head),
        even_blocks=even.blocks, ag_block_even=flat.ag_block, rs_block_even=flat.rs_block)


def max_even_units(unit_bytes: Sequence[float], capacity_bytes: float) -> list[int]:
    """Indices of the largest number of units whose bytes sum to at most `capacity_bytes`.

    Smallest first is optimal (exchange argument): take any optimal set O and the greedy set
    G = the k smallest units. If |O| > k, O's |O| smallest units sum to at least G's k + 1
    smallest, which by greedy's stopping rule exceed the capacity: contradiction. Ties in
    size are broken by index, so the result is deterministic."""
    order = sorted(range(len(unit_bytes)), key=lambda i: (unit_bytes[i], i))
    chosen, used = [], 0.0
    for i in order:
        if used + unit_bytes[i] > capacity_bytes:
            break
        chosen.append(i)
        used += unit_bytes[i]
    return sorted(chosen)


def fits(model: ModelConfig, precision: str, even: EvenUnits, rooms: Sequence[float],
         state_bytes: float, rtol: float = 1e-9) -> bool:
    """Whether `even` admits a partition: every rank holds 1/N of the even units within its
    room, and all the state fits in the summed room (see the module docstring)."""
    n = len(rooms)
    share = even_state_bytes(model, precision, even) / n
    return (all(share <= room * (1 + rtol) + 1e-9 for room in rooms)
            and state_bytes <= sum(rooms) * (1 + rtol) + 1e-9)


def unit_shard_ratios(even: EvenUnits, num_layers: int, world_size: int,
                      skewed: Sequence[float]) -> tuple[list[float], dict[str, list[float]]]:
    """(rank ratios, per-unit overrides) as a plan carries them: the ratio vector most units
    use is the ranks' `shard_ratio`; the other units are listed (by engine unit index)."""
    flat = [1.0 / world_size] * world_size
    even_units = even.unit_indices(num_layers)
    num_units = num_layers + 2
    if not even_units:
        return list(skewed), {}
    if len(even_units) == num_units:
        return flat, {}
    if 2 * len(even_units) > num_units:  # most units even: list the skewed ones
        skewed_units = [u for u in range(num_units) if u not in set(even_units)]
        return flat, {str(u): list(skewed) for u in skewed_units}
    return list(skewed), {str(u): list(flat) for u in even_units}
