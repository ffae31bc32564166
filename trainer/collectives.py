"""Uneven AllGather / ReduceScatter of flat unit buffers, asynchronous, on gloo and NCCL.

Neither backend has a native collective for arbitrary per-rank sizes that works everywhere
(measured on torch 2.13 gloo: `all_gather_single` and `all_gather(list)` fail on uneven sizes,
`invalid tensor size`; `reduce_scatter_single` asks `outputShape[0] * worldSize ==
inputShape[0]`; only `reduce_scatter(list)` takes uneven sizes), so:

* **AllGather** — NCCL with even shards: `all_gather_into_tensor` straight into the full
  buffer. Otherwise (gloo, or uneven shards): one async `broadcast` per non-empty shard,
  each *directly into its slice of the full buffer* (no padding, no copy-out; measured 2–4x
  faster than the padded form on gloo; on NCCL the padded `[world, largest]` form would
  hold up to world x the unit beside it, outside the memory model).
* **ReduceScatter** (SUM) — NCCL with even shards: `reduce_scatter_tensor`. NCCL uneven:
  one in-place `reduce` per owner of its slice (again no padding). gloo: an in-place
  `all_reduce` of the full gradient and a copy of this rank's slice (what gloo's own
  `reduce_scatter(list)` does, less the flat copy of its inputs it makes first). Outside
  NCCL's even path the full gradient's storage is freed when the shard is out.

* Hybrid sharding's collectives across replica groups (`cephalo.trainer.replicas`) are
  these two, on the ranks of one position, counted under their own kinds (`CROSS`), and
  an asynchronous SUM `all_reduce` of a flat gradient (the replicated prefix of a slice).

No NCCL form has run here (NCCL wants one GPU per rank; the device machine has one). The
uneven ones are the same calls the tests run on gloo (the gathers are shared code;
`reduce_by_owner` runs the per-owner reduce there).

Every call is issued with ``async_op=True`` and returns a `Pending` whose `wait()` is
timed, so the engine can prefetch the next unit while the current one computes and report
how long compute actually waited for the network: on the host's clock where `wait()` blocks
(gloo), on the compute stream's where it does not (NCCL; `cephalo.trainer.wait_clock`,
counted at `CollectiveStats.settle()`). Counters record logical collectives per
kind (one AllGather = one unit gathered, however many broadcasts it took), which the tests
use to prove layered accumulation gathers each unit once per pass.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cephalo.trainer.wait_clock import HostWaitClock, WaitClock, cuda_wait_clock

# What a collectives object made with ``kind_prefix=CROSS`` counts its gathers and
# reduce-scatters as: hybrid sharding's collectives across replica groups
# (cephalo.trainer.replicas), apart from those inside a group in the shared stats.
CROSS = "cross_"
CROSS_REDUCE_SCATTER = CROSS + "reduce_scatter"
CROSS_ALL_GATHER = CROSS + "all_gather"
CROSS_ALL_REDUCE = CROSS + "all_reduce"


@dataclass
class Pending:
    """An in-flight collective; `wait()` returns its result tensor."""

    works: list
    result: torch.Tensor
    kind: str
    stats: CollectiveStats
    finish: Callable[[], None] | None = None
    done: bool = False
    # An emulated link (CEPHALO_LINK_BYTES_PER_SECOND): the collective is not done before
    # this perf_counter time, however fast the real transport was.
    not_before: float = 0.0

    def wait(self) -> torch.Tensor:
        if not self.done:
            clock = self.stats.clock
            token = clock.start()
            for w in self.works:
                w.wait()
            if self.finish is not None:
                self.finish()
            clock.stop(self.kind, token, self.stats.wait_seconds)
            if self.not_before > 0.0:
                slept = max(0.0, self.not_before - time.perf_counter())
                time.sleep(slept)
                self.stats.wait_seconds[self.kind] += slept
            self.done = True
            # The works and the copy-out reach the collective's inputs (a full unit buffer):
            # let them go now, not when the last reference to this Pending does.
            self.works, self.finish = [], None
        return self.result

    def release(self) -> None:
        """Wait, then let go of the result's memory, however many references to this
        collective remain (a rank that only takes part and needs nothing of it)."""
        self.wait()
        self.result = self.result.new_empty(0)


@dataclass
class CollectiveStats:
    calls: Counter = field(default_factory=Counter)  # logical collectives by kind
    native_calls: Counter = field(default_factory=Counter)  # backend calls by kind
    elements: Counter = field(default_factory=Counter)
    # bytes of the buffer each collective fills, by kind: what travels (a gather in bf16
    # counts 2 bytes a parameter, the fp32 one 4)
    payload_bytes: Counter = field(default_factory=Counter)
    # seconds compute waited in wait() by kind, as far as settled: floats, so a defaultdict
    # (a Counter is for counts)
    wait_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    log: list[tuple[str, int]] = field(default_factory=list)  # (kind, unit) in issue order
    # How waits are timed: the host's clock, or the compute stream's under NCCL, whose
    # waits count in wait_seconds only at settle().
    clock: WaitClock = field(default_factory=HostWaitClock)

    def settle(self) -> None:
        """Count the waits timed so far (under NCCL: call after the stream has passed them,
        e.g. after a synchronisation, or this blocks until it has)."""
        self.clock.settle(self.wait_seconds)

    def reset(self) -> None:
        for c in (self.calls, self.native_calls, self.elements, self.payload_bytes,
                  self.wait_seconds):
            c.clear()
        self.log.clear()
        self.clock.discard()


class UnevenCollectives:
    """Collectives over one process group for shards of known, possibly uneven, sizes."""

    def __init__(self, group: dist.ProcessGroup | None = None, standalone: bool = False,
                 kind_prefix: str = "") -> None:
        """`standalone`: one process on its own, whether or not a process group exists (the
        profiler times a single-rank step inside a rank of a larger job). `kind_prefix`:
        prepended to the kinds its gathers and reduce-scatters count as (CROSS: hybrid
        sharding's collectives across groups, which share the stats of those inside)."""
        self.group = group
        self.gather_kind = kind_prefix + "all_gather"
        self.scatter_kind = kind_prefix + "reduce_scatter"
        # (kind_prefix "" would count it as the step's small all-reduce: cross-group only)
        self.reduce_kind = kind_prefix + "all_reduce"
        self.stats = CollectiveStats()
        # Tests and emulation: every collective also crosses one serial link of this many
        # bytes/s (a ring moves (n-1)/n of the buffer), so a slow network can be emulated
        # on one machine; None: the transport as it is.
        self.link_bytes_per_second: float | None = None
        self._link_free = 0.0  # perf_counter time the emulated link is next free
        if standalone:
            self.rank, self.world_size, self.backend = 0, 1, "none"
            self.reduce_by_owner = False
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        if self.backend == "nccl":
            # wait() returns at once; the compute stream waits (wait_clock.py).
            self.stats.clock = cuda_wait_clock()
        # NCCL's uneven reduce-scatter (a reduce per owner) on any backend: tests run it on
        # gloo, whose all-reduce is the default there.
        self.reduce_by_owner = False

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_gather(self, shard: torch.Tensor, bounds: list[tuple[int, int]], unit: int,
                   dtype: torch.dtype | None = None, wire_dtype: torch.dtype | None = None
                   ) -> Pending:
        """Gather every rank's shard of a flat buffer into a new full buffer (of `dtype`,
        default the shard's). `wire_dtype` (e.g. bf16 for fp32 shards): the shards travel
        in it, half the bytes, and the result is widened back, every rank's slice alike
        (its own too), so every rank holds the same rounded weights."""
        numel = bounds[-1][1]
        out_dtype = dtype or shard.dtype
        if wire_dtype is not None and wire_dtype != out_dtype and self.world_size > 1:
            return self._narrow_gather(shard, bounds, unit, out_dtype, wire_dtype)
        self._count(self.gather_kind, unit, numel, out_dtype)
        if self.world_size == 1 and (dtype is None or dtype == shard.dtype):
            # The shard is the whole buffer: hand out an alias (own autograd identity, same
            # storage) instead of a copy. Nothing writes to it until the optimizer step.
            return Pending([], shard.detach(), self.gather_kind, self.stats, done=True)
        full = torch.empty(numel, dtype=dtype or shard.dtype, device=shard.device)
        if self.world_size == 1:
            full.copy_(shard)
            return Pending([], full, self.gather_kind, self.stats, done=True)
        return self._over_link(Pending(self._gather_into(full, shard, bounds), full,
                                       self.gather_kind, self.stats))

    def _gather_into(self, full: torch.Tensor, shard: torch.Tensor,
                     bounds: list[tuple[int, int]]) -> list:
        """Start gathering every rank's shard into `full` (this rank's copied in, cast to
        `full`'s dtype); returns the works."""
        start, end = bounds[self.rank]
        full[start:end].copy_(shard)
        if self.backend == "nccl" and _even(bounds):
            self.stats.native_calls[self.gather_kind] += 1
            return [dist.all_gather_into_tensor(full, full[start:end].clone(),
                                                group=self.group, async_op=True)]
        # Uneven (or gloo): each owner broadcasts its shard straight into its slice of the
        # full buffer. No padding: the padded [world, largest] gather would hold up to
        # world x the unit (a unit owned by one rank: 8 x on 8 GPUs) beside the full buffer,
        # beyond the memory model's unit buffers, and move as much more over the network.
        works = [dist.broadcast(full[s:e], src=self._global_rank(r), group=self.group,
                                async_op=True)
                 for r, (s, e) in enumerate(bounds) if e > s]
        self.stats.native_calls[self.gather_kind] += len(works)
        return works

    def _narrow_gather(self, shard: torch.Tensor, bounds: list[tuple[int, int]], unit: int,
                       out_dtype: torch.dtype, wire_dtype: torch.dtype) -> Pending:
        """`all_gather` over a `wire_dtype` buffer, widened to `out_dtype` once it is in.
        The wide buffer exists only from then on (beside the narrow one for the copy)."""
        numel = bounds[-1][1]
        self._count(self.gather_kind, unit, numel, wire_dtype)
        wire = torch.empty(numel, dtype=wire_dtype, device=shard.device)
        pending = self._over_link(Pending(self._gather_into(wire, shard, bounds), wire,
                                          self.gather_kind, self.stats))

        def widen() -> None:
            pending.result = wire.to(out_dtype)
            # Freed now: gloo's worker thread holds the finished collective, and the
            # buffer, until it next runs (passes.release).
            wire.untyped_storage().resize_(0)

        pending.finish = widen
        return pending

    def reduce_scatter(self, full_grad: torch.Tensor, bounds: list[tuple[int, int]],
                       unit: int, *, consume: bool = True,
                       wire_dtype: torch.dtype | None = None) -> Pending:
        """SUM-reduce a full flat gradient across ranks; the result is this rank's shard.

        `full_grad` is the collective's to overwrite. `consume`: outside NCCL's even path
        its storage is freed as soon as the shard is out (the engine never reads a full
        gradient after its reduce-scatter); pass False to reuse the buffer (the collective
        profiler does). `wire_dtype` (e.g. bf16 for an fp32 gradient): the gradient is
        rounded to it and reduced in it (the backend sums in that format), half the bytes;
        the shard comes back widened to `full_grad`'s dtype."""
        start, end = bounds[self.rank]
        narrow = wire_dtype is not None and wire_dtype != full_grad.dtype and \
            self.world_size > 1
        if narrow:
            buf = full_grad.to(wire_dtype)
            if consume and _whole(full_grad):
                full_grad.untyped_storage().resize_(0)
        else:
            buf = full_grad
        self._count(self.scatter_kind, unit, buf.numel(), buf.dtype)
        if self.world_size == 1:
            return Pending([], full_grad[start:end], self.scatter_kind, self.stats, done=True)
        out = torch.empty(end - start, dtype=full_grad.dtype, device=full_grad.device)
        if self.backend == "nccl" and _even(bounds):
            self.stats.native_calls[self.scatter_kind] += 1
            shard = torch.empty(end - start, dtype=buf.dtype, device=buf.device) \
                if narrow else out
            work = dist.reduce_scatter_tensor(shard, buf, group=self.group, async_op=True)

            def widen() -> None:
                out.copy_(shard)

            return self._over_link(Pending([work], out, self.scatter_kind, self.stats,
                                           finish=widen if narrow else None), buf)
        if self.backend == "nccl" or self.reduce_by_owner:
            # Uneven: one in-place reduce per owner of its slice (no padded copy; together
            # they move what a reduce-scatter moves).
            works = [dist.reduce(buf[s:e], dst=self._global_rank(r),
                                 op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                     for r, (s, e) in enumerate(bounds) if e > s]
        else:
            # gloo runs `reduce_scatter(list)` as a copy of the inputs into one flat buffer,
            # an all-reduce of that copy and a copy-out: a second full gradient alive while
            # it runs, which the memory model does not count (measured). The gradient is
            # flat already: all-reduce it in place, gloo's reduction without the copy.
            works = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)]
        self.stats.native_calls[self.scatter_kind] += len(works)
        # (a view of a larger buffer is its owner's to free; a narrowed copy is ours)
        free = narrow or (consume and _whole(buf))

        def slice_out() -> None:
            out.copy_(buf[start:end])
            if free:
                # Freed here, not when the last reference goes: gloo's worker thread holds
                # the finished collective, and the buffer, until it next runs.
                buf.untyped_storage().resize_(0)

        return self._over_link(Pending(works, out, self.scatter_kind, self.stats,
                                       finish=slice_out), buf)

    def all_reduce(self, grad: torch.Tensor, unit: int, *,
                   wire_dtype: torch.dtype | None = None) -> Pending:
        """Start a SUM all-reduce of a flat gradient (the collective's to overwrite); the
        result, on every rank the same, is the sum in `grad`'s dtype. `wire_dtype`: rounded
        to it and summed in it, as `reduce_scatter` does. One backend all-reduce (a ring:
        a reduce-scatter and an all-gather's bytes); its result is copied out of one
        reduction, so every rank holds the same values."""
        narrow = wire_dtype is not None and wire_dtype != grad.dtype and self.world_size > 1
        buf = grad.to(wire_dtype) if narrow else grad
        self._count(self.reduce_kind, unit, buf.numel(), buf.dtype)
        if self.world_size == 1:
            return Pending([], grad, self.reduce_kind, self.stats, done=True)
        self.stats.native_calls[self.reduce_kind] += 1
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def widen() -> None:
            grad.copy_(buf)
            buf.untyped_storage().resize_(0)  # ours: a narrowed copy

        pending = Pending([work], grad, self.reduce_kind, self.stats,
                          finish=widen if narrow else None)
        # A ring all-reduce crosses the link twice: as a reduce-scatter and an all-gather.
        return self._over_link(self._over_link(pending, buf), buf)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Blocking SUM all-reduce of a small tensor (once per step: grad-norm, loss, and what
        rides along — every rank's timings, the trainer's stop and checkpoint votes)."""
        self._count("all_reduce", -1, values.numel(), values.dtype)
        if self.world_size > 1:
            self.stats.native_calls["all_reduce"] += 1
            # Blocking on gloo; under NCCL it too only makes the compute stream wait.
            token = self.stats.clock.start()
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
            self.stats.clock.stop("all_reduce", token, self.stats.wait_seconds)
            link = self._over_link(Pending([], values, "all_reduce", self.stats, done=True))
            if link.not_before > 0.0:
                slept = max(0.0, link.not_before - time.perf_counter())
                time.sleep(slept)
                self.stats.wait_seconds["all_reduce"] += slept
        return values

    def _over_link(self, pending: Pending, buffer: torch.Tensor | None = None) -> Pending:
        """`pending` (of the full `buffer`, default its result) also crossing the emulated
        link, if one is set: queued behind the collectives issued before it (a ring moves
        (n-1)/n of the buffer)."""
        if self.link_bytes_per_second is None:
            return pending
        full = pending.result if buffer is None else buffer
        seconds = (self.world_size - 1) / self.world_size * full.numel() * \
            full.element_size() / self.link_bytes_per_second
        self._link_free = max(time.perf_counter(), self._link_free) + seconds
        pending.not_before = self._link_free
        return pending

    def _count(self, kind: str, unit: int, numel: int, dtype: torch.dtype) -> None:
        self.stats.calls[kind] += 1
        self.stats.elements[kind] += numel
        self.stats.payload_bytes[kind] += numel * dtype.itemsize
        self.stats.log.append((kind, unit))


def _whole(t: torch.Tensor) -> bool:
    """`t` is its storage's only tensor (so freeing the storage frees no one else's)."""
    return t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _even(bounds: list[tuple[int, int]]) -> bool:
    sizes = {e - s for s, e in bounds}
    return len(sizes) == 1
