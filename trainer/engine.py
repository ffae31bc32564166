"""Uneven-shard FSDP with layered gradient accumulation (the Cephalo trainer engine).

One optimizer step on rank i, with its ℓ_i microbatches and U units (embedding, blocks,
head):

1. **Forward**, unit by unit: gather the unit (prefetching the next unit's gather while it
   computes), run *all* ℓ_i microbatches through it without autograd, keep only the unit
   boundary activations (offloaded to host when enabled), free the gathered parameters.
2. **Head**: forward and backward at once per microbatch (nothing to recompute), weighted
   by 1/B; the head's gradient is reduce-scattered right away.
3. **Backward**, units in reverse: gather, recompute + backward every microbatch (the
   parameter gradient accumulates in the flat buffer; a kept block's graphs instead, below),
   reduce-scatter the unit's gradient asynchronously (overlapping the next unit's backward),
   free.
4. **Optimizer**: one all-reduce of [Σ grad², Σ loss, every rank's compute and wait
   seconds so far, the caller's votes]; global-norm clipping; AdamW on the fp32 master
   shards. The trainer's logs and its stop vote ride on this all-reduce, so the loop around
   `step` needs no collective of its own. With fp16 ranks, a non-finite norm is the job's
   overflow verdict: every rank skips the update and the loss scale backs off
   (`cephalo.trainer.precision`, docs/precision.md).

So each unit is gathered once per pass (the head once per step) and reduce-scattered once
per step, whatever ℓ_i. A rank with no batch runs the same collectives on empty work.

Under hybrid sharding (`Layout.replica_groups`, docs/hybrid-sharding.md) the gathers and
reduce-scatters run inside the rank's replica group (`shard_comm`) on its fp32 slice, whose
optimizer state is split across the groups (`cephalo.trainer.replicas.CrossGroupShards`):
each slice gradient is reduce-scattered across the groups into this rank's piece (started
as the next reduce-scatter is issued), the optimizer updates the piece, and the pieces are
all-gathered back into the slices, each waited for just before the next step's forward
gathers its unit. The end-of-step all-reduce spans the world (`comm`).

Between recomputing everything and keeping everything, a rank may keep the autograd graphs
of its last k blocks (`Layout.kept_blocks`, a plan's `kept_blocks`): their forward runs
with autograd and their backward needs no recompute, but their gathered parameters are
still freed after the forward (the graphs keep views of a buffer whose storage is resized
to zero) and gathered again for the backward, so every rank issues the same collectives
whatever it keeps. The last blocks that every rank keeps run per microbatch with the head
instead (a "fused tail": forward through them and straight back, one microbatch's graphs
alive at a time, parameters held from their gather to the end of the tail, no second
gather on any rank) wherever that needs no more memory than their layered graphs
(`cephalo.api.memory.fused_tail_blocks`). With ``recompute=False`` the forward keeps every
graph and every gathered unit instead (more memory, no recompute, no second gather). The
passes themselves are in `cephalo.trainer.passes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch
import torch.distributed as dist

from cephalo.api import memory
from cephalo.api.job import TrainingSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer import passes
from cephalo.trainer.collectives import CROSS, Pending, UnevenCollectives
from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.models import build_unit
from cephalo.trainer.optim import OptimizerState, ShardedAdamW, learning_rate
from cephalo.trainer.precision import PRECISIONS, LossScaler, LossScaleState
from cephalo.trainer.replicas import (
    CrossGroupShards,
    ReplicaGroups,
    build_replica_groups,
    check_groups,
    file_bounds,
    file_index,
    group_ratios,
    piece_index,
)
from cephalo.trainer.unit_ops import ActivationStore, BlockTiming, run_unit_for_profile

__all__ = ["BlockTiming", "Engine", "Layout", "StepResult", "run_unit_for_profile"]

# A job's gatherPrecision / reducePrecision -> what parameter all-gathers / gradient
# reduce-scatters move (None: the fp32 of the masters and gradients).
WIRE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


@dataclass(frozen=True)
class Layout:
    """What the engine needs from a plan: every rank's batch and shard fraction.

    `unit_shard_ratios` optionally overrides the ratios of single units (unit index ->
    one ratio per rank): the paper shards some units evenly and others skewed when that
    saves uneven collectives. A plan carries it as ``"unit_shard_ratios": {"0": [...]}``.
    `kept_blocks`: how many of its last blocks each rank keeps the graphs of in recompute
    mode (a plan's ``ranks[i].kept_blocks``); empty = none on every rank.
    `graph_bytes_per_sample`: per rank, the block graph size the plan priced its kept blocks
    with (None or empty: the estimate from the dimensions); every rank reads all of them to
    agree on the tail they run per microbatch (`cephalo.api.memory.fused_tail_blocks`).
    `precisions`: per rank, the precision it computes in (a plan's ``ranks[i].precision``;
    None or empty: the job's); every rank reads all of them to agree on loss scaling.
    `replica_groups`: hybrid sharding (a plan's ``replica_groups``, cephalo.trainer.replicas):
    the ranks in groups of one size, each holding the whole state sharded among its ranks;
    a rank's shard ratios (and each unit's) are then its share within its group. Empty:
    flat, one group of every rank. Batches stay per rank over the whole job either way.
    `replicated_fraction`: with two or more groups, the leading share of every slice whose
    whole optimizer state each group keeps (its gradient all-reduced across groups; a plan's
    ``replicated_fraction``, cephalo.trainer.replicas).
    """

    batch_sizes: list[int]
    micro_batch_sizes: list[int]
    shard_ratios: list[float]
    unit_shard_ratios: dict[int, list[float]] = field(default_factory=dict)
    kept_blocks: list[int] = field(default_factory=list)
    graph_bytes_per_sample: list[float | None] = field(default_factory=list)
    precisions: list[str | None] = field(default_factory=list)
    replica_groups: list[list[int]] = field(default_factory=list)
    replicated_fraction: float = 0.0

    def ratios_for(self, unit: int) -> list[float]:
        """Unit `unit`'s ratios by rank (under hybrid sharding: within each rank's group;
        `group_ratios` gives them by position)."""
        return self.unit_shard_ratios.get(unit, self.shard_ratios)

    def group_ratios_for(self, unit: int) -> list[float]:
        """Unit `unit`'s ratios by position in a shard group: every rank's when flat."""
        ratios = self.ratios_for(unit)
        return group_ratios(self.replica_groups, ratios) if self.replica_groups else ratios

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    @property
    def world_size(self) -> int:
        return len(self.batch_sizes)

    def sample_range(self, rank: int) -> tuple[int, int]:
        """Rank's slice [start, end) of each step's global batch."""
        start = sum(self.batch_sizes[:rank])
        return start, start + self.batch_sizes[rank]


@dataclass
class StepResult:
    step: int  # 1-based index of the step just taken
    loss: float  # mean loss over the global batch
    grad_norm: float  # before clipping
    learning_rate: float
    step_seconds: float
    collective_wait_seconds: float  # time compute waited on collectives (this rank)
    # Every rank's seconds of compute / of waiting on collectives in this step up to the
    # end-of-step all-reduce that carried them (so without the optimizer update), by rank.
    rank_compute_seconds: list[float] = field(default_factory=list)
    rank_wait_seconds: list[float] = field(default_factory=list)
    votes: list[float] = field(default_factory=list)  # the callers' votes, summed over ranks
    # Loss scaling (a job with an fp16 rank): some rank's gradient overflowed, so no rank
    # stepped the optimizer; the loss scale the step ran with.
    skipped: bool = False
    loss_scale: float = 1.0


class EngineState(TypedDict):
    """`Engine.state_dict()`: what a checkpoint saves of one rank."""

    step_count: int  # optimizer steps done (the checkpoint's step)
    optimizer: OptimizerState
    loss_scale: LossScaleState  # the job's (the same on every rank; older states lack it)


class Engine:
    def __init__(self, config: ModelConfig, training: TrainingSpec, layout: Layout, *,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 precision: str = "fp32", recompute: bool = True,
                 offload: bool | None = None, time_dilation: float = 1.0,
                 standalone: bool = False, gather_precision: str = "fp32",
                 reduce_precision: str = "fp32",
                 replicas: ReplicaGroups | None = None) -> None:
        """`replicas`: the process groups of `layout.replica_groups`, built once per run
        (None: built here when the layout has groups; a collective over the default group)."""
        # standalone: a single rank that needs no process group (see UnevenCollectives).
        # `comm` spans the world (the end-of-step all-reduce, evaluation, the loop's
        # checks); `shard_comm` gathers and reduce-scatters the units: `comm` itself when
        # flat, the rank's replica group's under hybrid sharding.
        self.comm = UnevenCollectives(group, standalone=standalone)
        self.rank = self.comm.rank
        if layout.world_size != self.comm.world_size:
            raise ValueError(f"layout has {layout.world_size} ranks, process group has "
                             f"{self.comm.world_size}")
        for unit, ratios in layout.unit_shard_ratios.items():
            if len(ratios) != layout.world_size or (
                    not layout.replica_groups and abs(sum(ratios) - 1) > 1e-9):
                raise ValueError(f"unit_shard_ratios[{unit}] needs {layout.world_size} ratios "
                                 f"summing to 1, got {ratios}")
        self.shard_comm = self.comm
        # Hybrid sharding over more than one group: the pieces' collectives across groups.
        self.cross: CrossGroupShards | None = None
        self._cross_comm: UnevenCollectives | None = None
        self.position = self.rank  # this rank's slice: its place in its shard group
        self.group_index = 0  # its replica group
        self.piece = 0  # the piece of its slice it owns the state of (replicas.piece_index)
        self.groups_count = 1  # G, the replica groups (1: flat)
        if layout.kept_blocks:
            if len(layout.kept_blocks) != layout.world_size:
                raise ValueError(f"kept_blocks needs one count per rank ({layout.world_size}), "
                                 f"got {layout.kept_blocks}")
            if any(not 0 <= k <= config.num_layers for k in layout.kept_blocks):
                raise ValueError(f"kept_blocks must be between 0 and the {config.num_layers} "
                                 f"blocks, got {layout.kept_blocks}")
            if layout.graph_bytes_per_sample and \
                    len(layout.graph_bytes_per_sample) != layout.world_size:
                raise ValueError(f"graph_bytes_per_sample needs one figure per rank "
                                 f"({layout.world_size}), got {layout.graph_bytes_per_sample}")
            if not recompute and any(layout.kept_blocks):
                raise ValueError(f"kept_blocks {layout.kept_blocks} is for recompute mode; "
                                 "recompute=False keeps every block's graph already")
        if layout.precisions and len(layout.precisions) != layout.world_size:
            raise ValueError(f"precisions needs one per rank ({layout.world_size}), got "
                             f"{layout.precisions}")
        precisions = [p or precision for p in layout.precisions] or [precision]
        for p in precisions:
            if p not in PRECISIONS:
                raise ValueError(f"precision {p!r} is not one of {', '.join(PRECISIONS)} "
                                 "(a job's auto is resolved per rank by the planner)")
        self.config = config
        self.training = training
        self.layout = layout  # set_batch_sizes moves its split; the plan's stays here:
        self.planned_batch_sizes = list(layout.batch_sizes)
        self.device = device or torch.device("cpu")
        # This rank's compute precision (its plan entry's, else the job's).
        self.precision = precisions[self.rank] if layout.precisions else precision
        # One loss scale for the job whenever any rank computes in fp16: every rank updates
        # it from the same all-reduced verdict (precision.py), only fp16 ranks apply it.
        self.loss_scaling = "fp16" in precisions
        self.scaler = LossScaler()
        self.recompute = recompute
        # gather_precision bf16: parameters travel in bf16 (half the bytes) and are widened
        # on arrival, so every rank computes from the same bf16-rounded weights; the masters
        # are untouched. reduce_precision bf16: each full gradient is rounded to bf16, summed
        # in bf16 by the backend and its shard widened (half the bytes, coarser sums). Job
        # fields gatherPrecision / reducePrecision, the same on every rank.
        for name, value in (("gather_precision", gather_precision),
                            ("reduce_precision", reduce_precision)):
            if value not in WIRE_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(WIRE_DTYPES)}, got "
                                 f"{value!r}")
        self.gather_dtype = WIRE_DTYPES[gather_precision]
        self.reduce_dtype = WIRE_DTYPES[reduce_precision]
        # Blocks L-k+1..L (engine units) keep their graphs from forward to backward.
        self.kept_blocks = layout.kept_blocks[self.rank] if layout.kept_blocks else 0
        # What one sample's block graph holds, as the plan priced it (the profile's
        # measurement; None: cephalo.api.memory's estimate from the dimensions).
        self.graph_bytes_per_sample = layout.graph_bytes_per_sample[self.rank] \
            if layout.graph_bytes_per_sample else None
        # Of those, the last blocks every rank keeps run per microbatch (passes.py) where
        # that costs no rank more memory: computed from the layout alone, so every rank
        # agrees on which gathers they all skip.
        self.fused_tail = memory.fused_tail_blocks(
            layout.kept_blocks, layout.batch_sizes, layout.micro_batch_sizes,
            config.tokens_per_sample, config.hidden_size, config.ffn_hidden_size,
            config.block_parameters(), layout.graph_bytes_per_sample or None,
        ) if recompute and layout.kept_blocks else 0
        if time_dilation < 1.0:
            raise ValueError(f"time_dilation must be >= 1, got {time_dilation}")
        # Emulating a slower device (`cephalo run --emulate`): every unit's compute is
        # followed by a sleep of (d - 1) x its duration. Sleeping frees the core, so the
        # other ranks and in-flight collectives run as they would beside a slow GPU.
        self.time_dilation = time_dilation
        if not 0.0 <= layout.replicated_fraction <= 1.0 or (
                layout.replicated_fraction and len(layout.replica_groups) < 2):
            raise ValueError(f"replicated_fraction {layout.replicated_fraction} needs a value "
                             "in [0, 1] and two or more replica_groups, the layout has "
                             f"{len(layout.replica_groups)}")
        if layout.replica_groups:  # after every check of the arguments: it makes groups
            self._join_replica_groups(layout, replicas)
        use_offload = self.device.type == "cuda" if offload is None else offload
        self.store = ActivationStore(self.device, use_offload)
        # Every rank builds the same seeded units one at a time, keeps its shard of each and
        # frees the rest: initial weights never depend on the plan, and no rank ever holds
        # more than one full unit.
        self.units: list[FlatUnit] = []
        slices = []  # this rank's slice of every unit: what its group's gathers read
        for i in range(config.num_units):
            module = build_unit(config, i, seed=training.seed)
            unit = FlatUnit(i, module, layout.group_ratios_for(i), self.position)
            slices.append(unit.flatten()[unit.start:unit.end].clone().to(self.device))
            unit.detach_parameters()
            module.to(self.device)  # buffers (e.g. RoPE tables)
            self.units.append(unit)
        masks = [u.decay_mask_shard.to(self.device) for u in self.units]
        if self._cross_comm is None:  # flat or one group: the slice is the master
            self.optimizer = ShardedAdamW(slices, masks, training)
        else:
            self.cross = CrossGroupShards(self._cross_comm, slices, self.piece,
                                          self.groups_count, self.reduce_dtype,
                                          self.gather_dtype, layout.replicated_fraction)
            self.optimizer = ShardedAdamW(self.cross.masters(),
                                          [self.cross.master_of(u, m)
                                           for u, m in enumerate(masks)], training)
        self.step_count = 0

    def _join_replica_groups(self, layout: Layout, replicas: ReplicaGroups | None) -> None:
        """Hybrid sharding: shard within this rank's replica group, sum across groups."""
        groups = layout.replica_groups
        check_groups(groups, layout.shard_ratios, "shard ratios")
        for unit, ratios in layout.unit_shard_ratios.items():
            check_groups(groups, ratios, f"unit_shard_ratios[{unit}]")
        if self.comm.group is not None and self.comm.world_size != dist.get_world_size():
            raise ValueError("replica groups are built over the default process group; "
                             "run a hybrid layout on it")
        if replicas is None:
            replicas = build_replica_groups(groups, self.rank)
        elif replicas.groups != groups:
            raise ValueError(f"replicas were built for {replicas.groups}, the layout has "
                             f"{groups}")
        self.position, self.group_index = replicas.position, replicas.index
        self.piece = piece_index(groups, self.rank)
        self.groups_count = len(groups)
        self.shard_comm = UnevenCollectives(replicas.shard_group)
        # One account of every collective, whichever group ran it: the step's wait seconds
        # and the per-kind counts add up as they do when flat (the cross-group ones under
        # their own kinds, collectives.CROSS).
        self.shard_comm.stats = self.comm.stats
        if self.groups_count > 1:
            self._cross_comm = UnevenCollectives(replicas.cross_group, kind_prefix=CROSS)
            assert self._cross_comm.rank == self.piece, "torch numbers subgroups by rank"
            self._cross_comm.stats = self.comm.stats

    @property
    def collectives(self) -> list[UnevenCollectives]:
        """Every group's collectives this engine runs (one when flat)."""
        found = [self.comm, self.shard_comm] + ([self.cross.comm] if self.cross else [])
        return list({id(c): c for c in found}.values())

    # ---- what this rank owns, in a unit's global offsets (checkpoints) ----------------
    @property
    def file_index(self) -> int:
        """The number of the checkpoint file this rank writes (every rank writes one: its
        slice when flat, its piece of it under hybrid sharding)."""
        return file_index(self.position, self.piece, self.groups_count)

    def owned_ranges(self, unit: int) -> list[tuple[int, int]]:
        """Global [start, end) ranges of unit `unit` whose master and moments this rank
        holds, in the order its master concatenates them (one unless a replicated prefix
        and a piece other than 0: replicas.master_ranges)."""
        u = self.units[unit]
        if self.cross is None:
            return [(u.start, u.end)]
        return [(u.start + a, u.start + b) for a, b in self.cross.master_ranges(unit)]

    def file_range(self, unit: int) -> tuple[int, int, int]:
        """What this rank's checkpoint file holds of unit `unit`: global [start, end) and
        where in its master that part begins (past the replicated prefix, which only the
        owner of piece 0 writes)."""
        ranges = self.owned_ranges(unit)
        if self.cross is None or self.piece == 0:
            return ranges[0][0], ranges[0][1], 0
        return ranges[-1][0], ranges[-1][1], self.cross.heads[unit]

    def file_bounds(self, unit: int) -> list[tuple[int, int]]:
        """Every rank's `file_range` of unit `unit`, by file number."""
        return file_bounds(self.units[unit].bounds, self.groups_count,
                           self.layout.replicated_fraction)

    @torch.no_grad()
    def load_parameters(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Set the weights from `read(unit, start, end)` (fp32 values of a unit's global
        range): this rank's slices and, under hybrid sharding, the masters of its pieces.
        No collective: every rank reads its own slice."""
        if self.cross is not None:
            self.cross.settle()  # no all-gather may land on the slices after this
        for i, u in enumerate(self.units):
            values = read(i, u.start, u.end)
            if self.cross is None:
                self.optimizer.params[i].copy_(values)
                continue
            self.cross.slices[i].copy_(values)
            self.optimizer.params[i].copy_(self.cross.master_of(i, self.cross.slices[i]))

    # ---- checkpoint state (torch.distributed.checkpoint's Stateful protocol) --------
    def state_dict(self) -> EngineState:
        """This rank's training state: its shard of every unit's master weights and Adam
        moments, and the step counter (live tensors: see ShardedAdamW.state_dict)."""
        return {"step_count": self.step_count, "optimizer": self.optimizer.state_dict(),
                "loss_scale": self.scaler.state_dict()}

    def load_state_dict(self, state: EngineState) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        loss_scale = state.get("loss_scale")
        if loss_scale is not None:  # None: a state saved before loss scaling existed
            self.scaler.load_state_dict(loss_scale)

    # ---- loss scaling ----------------------------------------------------------------
    @property
    def loss_weight(self) -> float:
        """What this rank's per-sample losses are weighted by before backward: 1/B (the
        gradients summed over ranks are the mean loss's), times the loss scale on an fp16
        rank so that small gradients survive fp16's range."""
        scale = self.scaler.scale if self.precision == "fp16" else 1.0
        return scale / self.layout.global_batch_size

    def _reduce_scatter(self, u: int, full_grad: torch.Tensor) -> Pending:
        """Reduce-scatter unit `u`'s full gradient (fp32). An fp16 rank unscales it first
        (a power of two: exact), so every rank contributes the true gradient and the sum is
        right whatever the mix of precisions; an inf or nan stays one and reaches the
        owner's shard (the overflow verdict, `_optimizer_step`)."""
        if self.precision == "fp16":
            full_grad.mul_(1.0 / self.scaler.scale)
        pending = self.shard_comm.reduce_scatter(full_grad, self.units[u].bounds, u,
                                                 wire_dtype=self.reduce_dtype)
        return pending if self.cross is None else self.cross.follow(u, pending)

    # ---- parameters ----------------------------------------------------------------
    @property
    def master_shards(self) -> list[torch.Tensor]:
        """The fp32 masters this rank updates: its slices, or its pieces of them."""
        return self.optimizer.params

    @property
    def slices(self) -> list[torch.Tensor]:
        """This rank's slice of every unit, as its group's all-gathers read it (the masters
        themselves unless hybrid sharding splits them across groups). Not waited for: see
        `_slice`."""
        return self.master_shards if self.cross is None else self.cross.slices

    def _slice(self, index: int) -> torch.Tensor:
        """Unit `index`'s slice as of the last update: under hybrid sharding this waits
        for its cross-group all-gather, started after the optimizer step."""
        return self.master_shards[index] if self.cross is None else self.cross.slice(index)

    def _gather(self, index: int) -> Pending:
        """Unit `index`'s parameters for compute (in the job's gather precision)."""
        unit = self.units[index]
        return self.shard_comm.all_gather(self._slice(index), unit.bounds, index,
                                          wire_dtype=self.gather_dtype)

    def _exact_slice(self, index: int) -> torch.Tensor:
        """Unit `index`'s slice in fp32 exactly as the masters hold it: a slice gathered
        across groups in bf16 is rounded, so it is gathered again in fp32 then."""
        if self.cross is None or self.cross.gather_dtype is None:
            return self._slice(index)
        return self.cross.exact_slice(index, self.master_shards[index])

    def full_parameters(self) -> list[torch.Tensor]:
        """Every unit's full flat fp32 master weights (a collective: all ranks must call
        it), never rounded by the gather precision."""
        if self.cross is not None:
            self.cross.settle()  # the cross-group collectives run in the order issued
        return [self.shard_comm.all_gather(self._exact_slice(i), u.bounds, i).wait().detach()
                .to("cpu", copy=True) for i, u in enumerate(self.units)]

    # ---- evaluation -----------------------------------------------------------------
    def evaluate(self, micro_batches: list[MicroBatch]) -> tuple[float, int]:
        """(Σ per-sample loss, number of samples) over every rank's `micro_batches`: a
        forward without autograd, unit by unit (each gathered once, the next prefetched),
        then one all-reduce. A collective: every rank calls it, with or without samples.
        Only two unit boundaries are alive at a time, so a rank's share of a global batch
        needs less memory than its training step."""
        xs = [x.to(self.device, non_blocking=True) for x, _ in micro_batches]
        targets = [t.to(self.device, non_blocking=True) for _, t in micro_batches]
        return passes.evaluate(self, xs, targets)

    # ---- one step ------------------------------------------------------------------
    def step(self, micro_batches: list[MicroBatch],
             votes: Callable[[], Sequence[float]] | None = None) -> StepResult:
        """One optimizer step on this rank's microbatches of the global batch.

        `votes` (same length on every rank) is called just before the end-of-step
        all-reduce; its values, summed over ranks, come back in `StepResult.votes`: a
        step-boundary agreement (stop on SIGTERM, checkpoint uploads done) for free."""
        started = time.perf_counter()
        self.comm.stats.settle()  # waits since the last step (full_parameters, ...) are not its
        wait_before = sum(self.comm.stats.wait_seconds.values())
        expected = self.layout.batch_sizes[self.rank]
        got = sum(int(t.shape[0]) for _, t in micro_batches)
        if got != expected:
            raise ValueError(f"rank {self.rank} got {got} samples, its plan says {expected}")
        inputs = [x.to(self.device, non_blocking=True) for x, _ in micro_batches]
        targets = [t.to(self.device, non_blocking=True) for _, t in micro_batches]
        if self.cross is not None:
            self.cross.begin()
        if self.recompute:
            loss_sum, grads = passes.forward_backward_recompute(self, inputs, targets)
        else:
            loss_sum, grads = passes.forward_backward_keep(self, inputs, targets)
        result = self._optimizer_step(loss_sum, grads, started, wait_before, votes)
        result.step_seconds = time.perf_counter() - started
        self.comm.stats.settle()  # the all-reduce's wait: its result is on the host already
        result.collective_wait_seconds = sum(self.comm.stats.wait_seconds.values()) - wait_before
        return result

    @contextlib.contextmanager
    def _dilated(self) -> Iterator[None]:
        if self.time_dilation == 1.0:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            clock = time.perf_counter
        else:
            # CPU: dilate the work this thread did, not the time it spent descheduled while
            # other ranks held the cores (that would compound contention with dilation).
            clock = time.thread_time
        began = clock()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        time.sleep((self.time_dilation - 1.0) * (clock() - began))

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Run the next steps under another split of the same global batch (live
        rebalancing, cephalo.planner.feedback.rebalance): every rank calls it between the same two
        steps with the same split. Microbatch sizes, shards and the fused tail (chosen from
        the plan's split: every rank agrees on it, and its memory depends on the microbatch
        size only) stay; a rank whose batch is no multiple of its microbatch size runs a
        smaller last microbatch. The loss weight 1/B is unchanged, so one step still equals
        single-device training on the global batch."""
        old = self.layout
        new = [int(b) for b in batch_sizes]
        if len(new) != old.world_size or sum(new) != old.global_batch_size or min(new) < 0:
            raise ValueError(f"split {new} is not one of {old.global_batch_size} samples over "
                             f"{old.world_size} ranks")
        for r, (b, m) in enumerate(zip(new, old.micro_batch_sizes, strict=True)):
            if b > 0 and m < 1:
                raise ValueError(f"rank {r} has microbatch size {m}: it cannot take samples")
        self.layout = dataclasses.replace(old, batch_sizes=new)

    def memory_estimate_bytes(self, samples: int | None = None) -> int:
        """Device bytes this rank needs at least (cephalo.api.memory, the planner's model
        too): the training state of its shards (under hybrid sharding its fp32 slices, the
        state of its pieces and the slice gradient reduced across groups,
        `memory.hybrid_state_bytes`), the gathered unit buffers at the peak, and
        the boundary activations kept for backward when not offloaded and the graphs of
        the blocks this rank keeps (kept_blocks_bytes); without recompute, every block's
        graph and the gathered units kept alive instead (kept_graph_bytes). The working
        set inside one unit's compute comes on top. `samples`: this rank's batch (default:
        the layout's), as a rebalanced split would give it."""
        if samples is None:
            samples = self.layout.batch_sizes[self.rank]
        c = self.config
        if self.recompute:
            # A rank without samples takes part in the tail one unit at a time (passes.py).
            fused = self.fused_tail if samples else 0
            kept = memory.kept_boundary_bytes(c.num_layers, samples, c.tokens_per_sample,
                                              c.hidden_size, self.store.offload, fused)
            dims = (c.tokens_per_sample, c.hidden_size, c.ffn_hidden_size)
            kept += memory.kept_blocks_bytes(self.kept_blocks - fused, samples,
                                             *dims, self.graph_bytes_per_sample)
            kept += memory.fused_tail_bytes(fused,
                                            self.layout.micro_batch_sizes[self.rank], *dims,
                                            c.block_parameters(), self.graph_bytes_per_sample)
        else:
            kept = memory.kept_graph_bytes(c.num_layers, samples, c.tokens_per_sample,
                                           c.hidden_size, c.ffn_hidden_size,
                                           sum(u.numel for u in self.units[:-1]),
                                           self.graph_bytes_per_sample)
        slice_numel = sum(u.shard_numel for u in self.units)
        state = memory.hybrid_state_bytes(slice_numel, self.groups_count, self.precision,
                                          self.layout.replicated_fraction)
        if self.groups_count > 1:
            # The slice gradient of the unit whose cross-group reduce-scatter runs.
            state += memory.FP32_BYTES * max(u.shard_numel for u in self.units)
        return int(state + memory.unit_buffer_bytes(max(u.numel for u in self.units)) + kept)

    def _forward_backward_recompute(self, inputs: list[torch.Tensor],
                                    targets: list[torch.Tensor]
                                    ) -> tuple[torch.Tensor, list[Pending]]:
        """One recompute-mode pass without the optimizer step (bench/layered_accumulation)."""
        return passes.forward_backward_recompute(self, inputs, targets)

    def _prefetch_backward(self, u: int, mb: int, num_mb: int) -> None:
        if mb < num_mb:
            self.store.prefetch((u, mb))
            self.store.prefetch(("grad", u + 1, mb))

    def _optimizer_step(self, loss_sum: torch.Tensor, scatters: list[Pending],
                        started: float | None = None, wait_before: float = 0.0,
                        votes: Callable[[], Sequence[float]] | None = None) -> StepResult:
        grads = [p.wait() for p in scatters]
        if self.cross is not None:  # hybrid: the pieces' gradients, summed over the world
            grads = self.cross.finish(len(grads))
        opt = self.optimizer
        world = self.comm.world_size
        # [Σ grad², Σ loss, compute seconds by rank, wait seconds by rank, votes]: each rank
        # fills its own timing slots, so the SUM hands every rank everyone's timings.
        if self.device.type == "cuda" and started is not None:
            # Kernels run ahead of the host: time the work, not its queueing. Free here, as
            # the all-reduce below needs every gradient finished anyway.
            torch.cuda.synchronize(self.device)
        # Under NCCL the waits were timed on the compute stream, which has passed them now.
        self.comm.stats.settle()
        waited = sum(self.comm.stats.wait_seconds.values()) - wait_before
        elapsed = 0.0 if started is None else time.perf_counter() - started
        extra = torch.zeros(2 * world, dtype=torch.float64)
        extra[self.rank] = elapsed - waited
        extra[world + self.rank] = waited
        mine = [float(v) for v in votes()] if votes is not None else []
        # Under hybrid sharding every element's gradient is in exactly one rank's piece (a
        # replicated prefix counted by the owner of piece 0 only), so the world's sum of
        # Σ grad² counts each once: the norm is the flat one.
        cross = self.cross
        counted = grads if cross is None else [cross.unshared(u, g) for u, g in enumerate(grads)]
        squared = opt.squared_norm(counted).to(self.device)
        totals = torch.cat([torch.stack([squared, loss_sum.float()]).double(),
                            torch.cat([extra, torch.tensor(mine, dtype=torch.float64)]
                                      ).to(self.device)])
        values = self.comm.all_reduce_sum(totals).cpu().tolist()
        grad_norm = float(values[0]) ** 0.5
        lr = learning_rate(self.training, self.step_count)
        loss_scale = self.scaler.scale if self.loss_scaling else 1.0
        # Any rank's non-finite gradient made the summed squared norm non-finite on every
        # rank alike (precision.py): all skip the update, as torch.amp.GradScaler does; the
        # step's data is consumed all the same (the step counter moves, Adam's does not).
        skipped = self.loss_scaling and not math.isfinite(values[0])
        if not skipped:
            scale = opt.clip_factor(grad_norm, self.training.gradient_clip_norm)
            opt.step(grads, lr, grad_scale=scale)
            if self.cross is not None:  # the updated pieces back into every slice
                self.cross.publish(opt.params)
        if self.loss_scaling:
            self.scaler.update(found_inf=skipped)
        self.step_count += 1
        return StepResult(step=self.step_count,
                          loss=values[1] / self.layout.global_batch_size,
                          grad_norm=grad_norm, learning_rate=lr, step_seconds=0.0,
                          collective_wait_seconds=0.0,
                          rank_compute_seconds=values[2:2 + world],
                          rank_wait_seconds=values[2 + world:2 + 2 * world],
                          votes=values[2 + 2 * world:], skipped=skipped,
                          loss_scale=loss_scale)
