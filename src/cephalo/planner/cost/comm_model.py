"""The collectives' side of the cost model (`cephalo.planner.cost.costmodel`): ring collectives
over the cluster's network (`CommModel`) and the seconds of each collective one step issues
for a model, world size and sharding (`UnitComm`)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from cephalo.api.memory import COMM_BYTES_PER_PARAMETER
from cephalo.api.models import ModelConfig

# The paper measured uneven collectives at most 15% slower than even ones.
UNEVEN_COLLECTIVE_OVERHEAD = 0.15


class StepPricer(Protocol):
    """What `CommModel.calibrated` needs of a GPU's cost model (`costmodel.GpuCostModel` is
    one): its step seconds for candidate (ℓ, m) pairs under given collectives. A protocol,
    so that this module stays below the cost model and never imports it."""

    def step_seconds(self, ell: np.ndarray, m: np.ndarray, comm: UnitComm) -> np.ndarray: ...


@dataclass(frozen=True)
class CommModel:
    """Ring collectives: seconds = (n-1)/n · bytes / bandwidth + (n-1) · latency.

    AllGather and ReduceScatter may have their own (bandwidth, latency): a profiler measures
    both, and on gloo a ReduceScatter's fixed cost is several times an AllGather's. Without
    a measurement the step's small all-reduces cost 2(n-1) ring hops of latency each."""

    bandwidth_bytes_per_second: float
    latency_seconds: float
    uneven_overhead: float = UNEVEN_COLLECTIVE_OVERHEAD
    overlap_fraction: float = 1.0
    reduce_scatter_bandwidth_bytes_per_second: float | None = None
    reduce_scatter_latency_seconds: float | None = None
    all_reduce_seconds: float | None = None
    # Per step, what a measured real step took beyond this model's prediction of it (see
    # `calibrated`); added to every step on more than one GPU.
    step_overhead_seconds: float = 0.0
    # What one parameter puts on the wire per collective: the job's gatherPrecision and
    # reducePrecision (fp32 4 bytes, bf16 2), as the engine sends them (trainer/collectives.py).
    gather_bytes_per_parameter: float = COMM_BYTES_PER_PARAMETER
    reduce_bytes_per_parameter: float = COMM_BYTES_PER_PARAMETER

    def bytes_per_parameter(self, kind: str) -> float:
        return (self.reduce_bytes_per_parameter if kind == "reduce_scatter"
                else self.gather_bytes_per_parameter)

    def ring_seconds(self, num_bytes: float, world_size: int, uneven: bool,
                     kind: str = "all_gather") -> float:
        if world_size <= 1:
            return 0.0
        n = world_size
        bandwidth, latency = self.bandwidth_bytes_per_second, self.latency_seconds
        if kind == "reduce_scatter":
            bandwidth = self.reduce_scatter_bandwidth_bytes_per_second or bandwidth
            if self.reduce_scatter_latency_seconds is not None:
                latency = self.reduce_scatter_latency_seconds
        seconds = (n - 1) / n * num_bytes / bandwidth + (n - 1) * latency
        return seconds * (1.0 + self.uneven_overhead if uneven else 1.0)

    def calibrated(self, model: ModelConfig, costs: Iterable[StepPricer],
                   probe_step_seconds: float, world_size: int) -> CommModel:
        """This model plus the per-step overhead that makes its prediction of a measured
        probe step (one sample per rank, even shards, on `world_size` ranks of the fastest
        GPU type) come out exact. On NCCL the overhead is small; on gloo over a few shared
        CPU cores it holds what the per-collective fits cannot: ranks arriving at different
        times and the transport taking CPU from compute. It is never made negative enough to
        cancel more than the collectives' own modelled time."""
        unit = UnitComm.build(model, self, world_size, uneven=False)
        silent = unit.silent()
        one = np.ones(1)
        fastest = min(costs, key=lambda c: float(c.step_seconds(one, one, unit)[0]))
        predicted = float(fastest.step_seconds(one, one, unit)[0])
        collectives = predicted - float(fastest.step_seconds(one, one, silent)[0])
        overhead = max(probe_step_seconds - predicted, -collectives)
        return replace(self, step_overhead_seconds=overhead)

    def small_all_reduce_seconds(self, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        if self.all_reduce_seconds is not None:
            return self.all_reduce_seconds
        return 2 * (world_size - 1) * self.latency_seconds


@dataclass(frozen=True)
class UnitComm:
    """Seconds of each collective the step issues, for one world size and sharding.

    The engine gathers the embedding (exposed: nothing to hide it under), each block and the
    head in the forward pass; each block and the embedding again in the backward pass (the
    head's forward and backward are fused); and reduce-scatters every unit's gradient once."""

    ag_block: float
    rs_block: float
    ag_first: float  # the embedding unit, gathered in both passes
    ag_head: float
    rs_other: float  # embedding + head gradients: two collectives
    overlap_fraction: float = 1.0
    all_reduce_seconds: float = 0.0  # the step's fixed small all-reduces
    state_share_parameters: float = 0.0  # P / N: the optimizer's work per GPU
    step_overhead_seconds: float = 0.0  # measured, beyond the model (CommModel.calibrated)
    # Per-unit sharding (planner/search/unit_shards.py): `even_blocks` of the blocks are sharded
    # evenly and pay these even collectives; ag_block / rs_block price the other, skewed ones.
    even_blocks: int = 0
    ag_block_even: float = 0.0
    rs_block_even: float = 0.0
    # Hybrid sharding (planner/search/hybrid.py): the cross-group all-gather of a block's and of
    # the embedding's updated piece, which a unit's forward waits before its own gather
    # (the backward's gathers read the slice already there). The head's is in ag_head.
    cross_ag_block: float = 0.0
    cross_ag_first: float = 0.0
    # Hybrid sharding: the cross-group collective of a block's (and of the embedding's and
    # head's) slice gradient under the backward, issued after the unit's own reduce-scatter
    # (a reduce-scatter of the sharded part, an all-reduce of the replicated part).
    cross_rs_block: float = 0.0
    cross_rs_other: float = 0.0  # the head's
    # The embedding's: its gradient is the backward's last, so its cross-group collective
    # starts when nothing is left to hide it under (trainer/replicas.py `finish`): exposed.
    cross_rs_last: float = 0.0
    # Whether the cross-group collectives ride links of their own (every replica group one
    # node: the group's rings stay on the intra-node link, the cross-group ones on the NIC,
    # each on its own process group and stream): then a unit's backward waits the slower of
    # its group's collectives and its cross-group one, else (the NICs shared) their sum.
    cross_own_link: bool = False

    def backward_collectives(self, gather: float, reduce: float, cross: float) -> float:
        """Seconds of a unit's backward collectives: its gather (`gather`, 0 when the
        backward gathers nothing) and reduce-scatter in its group, and its cross-group
        collective `cross` (0 when flat). Summed as reduce + cross first so that a flat
        step, and a hybrid one sharing the NICs, prices as it did when the cross seconds
        were part of the reduce-scatter's."""
        if self.cross_own_link:
            return max(gather + reduce, cross)
        return gather + (reduce + cross)

    def silent(self) -> UnitComm:
        """The same step without its collectives (nor the overhead measured beyond them):
        its compute alone."""
        return replace(self, ag_block=0.0, rs_block=0.0, ag_first=0.0, ag_head=0.0,
                       rs_other=0.0, all_reduce_seconds=0.0, step_overhead_seconds=0.0,
                       ag_block_even=0.0, rs_block_even=0.0, cross_ag_block=0.0,
                       cross_ag_first=0.0, cross_rs_block=0.0, cross_rs_other=0.0,
                       cross_rs_last=0.0)

    @classmethod
    def build(cls, model: ModelConfig, comm: CommModel, world_size: int,
              uneven: bool) -> UnitComm:
        # Every argument is immutable (a frozen model and dataclass) and so is the answer:
        # the searches price the same few (world size, sharding) pairs for every candidate.
        return _built_unit_comm(model, comm, world_size, uneven)

    @classmethod
    def _build(cls, model: ModelConfig, comm: CommModel, world_size: int,
               uneven: bool) -> UnitComm:
        def ring(params: int, kind: str) -> float:
            return comm.ring_seconds(params * comm.bytes_per_parameter(kind), world_size,
                                     uneven, kind)

        embedding, block, head = (model.embedding_parameters(), model.block_parameters(),
                                  model.head_parameters())
        # Two small all-reduces per step: [grad norm, loss], and the per-rank timings.
        all_reduce = 2 * comm.small_all_reduce_seconds(world_size)
        return cls(ag_block=ring(block, "all_gather"), rs_block=ring(block, "reduce_scatter"),
                   ag_first=ring(embedding, "all_gather"), ag_head=ring(head, "all_gather"),
                   rs_other=ring(embedding, "reduce_scatter") + ring(head, "reduce_scatter"),
                   overlap_fraction=comm.overlap_fraction, all_reduce_seconds=all_reduce,
                   state_share_parameters=model.total_parameters() / max(world_size, 1),
                   step_overhead_seconds=comm.step_overhead_seconds if world_size > 1 else 0.0)


@functools.lru_cache(maxsize=4096)
def _built_unit_comm(model: ModelConfig, comm: CommModel, world_size: int,
                     uneven: bool) -> UnitComm:
    """UnitComm.build's answers, kept (bounded) by their immutable arguments."""
    return UnitComm._build(model, comm, world_size, uneven)
