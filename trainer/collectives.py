"""Uneven AllGather / ReduceScatter of flat unit buffers, asynchronous, on gloo and NCCL.

Neither backend has a native collective for arbitrary per-rank sizes that works everywhere
(see shared/reference/torch-notes.md), so:

* **AllGather** — gloo: one async `broadcast` per non-empty shard, each *directly into its
  slice of the full buffer* (no padding, no copy-out; measured 2–4x faster than the padded
  form on gloo). NCCL: when shards are even, `all_gather_into_tensor` straight into the full
  buffer; otherwise the padded `[world, max]` gather and a copy-out (FSDP's layout).
* **ReduceScatter** (SUM) — gloo: an in-place `all_reduce` of the full gradient and a copy
  of this rank's slice (what gloo's own `reduce_scatter(list)` does, less the flat copy of
  its inputs it makes first). NCCL: `reduce_scatter_tensor`, padded when uneven.

Every call is issued with ``async_op=True`` and returns a `Pending` whose `wait()` is
timed, so the engine can prefetch the next unit while the current one computes and report
how long compute actually waited for the network. Counters record logical collectives per
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


@dataclass
class Pending:
    """An in-flight collective; `wait()` returns its result tensor."""

    works: list
    result: torch.Tensor
    kind: str
    stats: CollectiveStats
    finish: Callable[[], None] | None = None
    done: bool = False

    def wait(self) -> torch.Tensor:
        if not self.done:
            started = time.perf_counter()
            for w in self.works:
                w.wait()
            if self.finish is not None:
                self.finish()
            self.stats.wait_seconds[self.kind] += time.perf_counter() - started
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
    # seconds blocked in wait() by kind: floats, so a defaultdict (a Counter is for counts)
    wait_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    log: list[tuple[str, int]] = field(default_factory=list)  # (kind, unit) in issue order

    def reset(self) -> None:
        for c in (self.calls, self.native_calls, self.elements, self.wait_seconds):
            c.clear()
        self.log.clear()


class UnevenCollectives:
    """Collectives over one process group for shards of known, possibly uneven, sizes."""

    def __init__(self, group: dist.ProcessGroup | None = None, standalone: bool = False
                 ) -> None:
        """`standalone`: one process on its own, whether or not a process group exists (the
        profiler times a single-rank step inside a rank of a larger job)."""
        self.group = group
        self.stats = CollectiveStats()
        if standalone:
            self.rank, self.world_size, self.backend = 0, 1, "none"
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_gather(self, shard: torch.Tensor, bounds: list[tuple[int, int]], unit: int,
                   dtype: torch.dtype | None = None) -> Pending:
        """Gather every rank's shard of a flat buffer into a new full buffer."""
        numel = bounds[-1][1]
        self._count("all_gather", unit, numel)
        if self.world_size == 1 and (dtype is None or dtype == shard.dtype):
            # The shard is the whole buffer: hand out an alias (own autograd identity, same
            # storage) instead of a copy. Nothing writes to it until the optimizer step.
            return Pending([], shard.detach(), "all_gather", self.stats, done=True)
        full = torch.empty(numel, dtype=dtype or shard.dtype, device=shard.device)
        if self.world_size == 1:
            full.copy_(shard)
            return Pending([], full, "all_gather", self.stats, done=True)
        start, end = bounds[self.rank]
        full[start:end].copy_(shard)
        sizes = [e - s for s, e in bounds]
        if self.backend == "nccl":
            return self._nccl_all_gather(full, sizes, bounds)
        works = []
        for r, (s, e) in enumerate(bounds):
            if e > s:
                works.append(dist.broadcast(full[s:e], src=self._global_rank(r),
                                            group=self.group, async_op=True))
        self.stats.native_calls["all_gather"] += len(works)
        return Pending(works, full, "all_gather", self.stats)

    def _nccl_all_gather(self, full: torch.Tensor, sizes: list[int],
                         bounds: list[tuple[int, int]]) -> Pending:
        self.stats.native_calls["all_gather"] += 1
        largest = max(sizes)
        if all(s == largest for s in sizes):
            start, end = bounds[self.rank]
            work = dist.all_gather_into_tensor(full, full[start:end].clone(), group=self.group,
                                               async_op=True)
            return Pending([work], full, "all_gather", self.stats)
        padded = torch.zeros(self.world_size * largest, dtype=full.dtype, device=full.device)
        start, end = bounds[self.rank]
        local = torch.zeros(largest, dtype=full.dtype, device=full.device)
        local[:end - start].copy_(full[start:end])
        work = dist.all_gather_into_tensor(padded, local, group=self.group, async_op=True)

        def copy_out() -> None:
            rows = padded.view(self.world_size, largest)
            for r, (s, e) in enumerate(bounds):
                full[s:e].copy_(rows[r, :e - s])

        return Pending([work], full, "all_gather", self.stats, finish=copy_out)

    def reduce_scatter(self, full_grad: torch.Tensor, bounds: list[tuple[int, int]],
                       unit: int, *, consume: bool = True) -> Pending:
        """SUM-reduce a full flat gradient across ranks; the result is this rank's shard.

        `consume`: on gloo, where the reduction happens in `full_grad` itself, its storage is
        freed as soon as the shard is out (the engine never reads a full gradient after its
        reduce-scatter); pass False to reuse the buffer (the collective profiler does)."""
        start, end = bounds[self.rank]
        self._count("reduce_scatter", unit, full_grad.numel())
        if self.world_size == 1:
            return Pending([], full_grad[start:end], "reduce_scatter", self.stats, done=True)
        self.stats.native_calls["reduce_scatter"] += 1
        out = torch.empty(end - start, dtype=full_grad.dtype, device=full_grad.device)
        sizes = [e - s for s, e in bounds]
        if self.backend != "nccl":
            # gloo runs `reduce_scatter(list)` as a copy of the inputs into one flat buffer,
            # an all-reduce of that copy and a copy-out: a second full gradient alive for as
            # long as the collective runs, which the memory model does not count and which
            # overlapped the backward's peak only when gloo's thread lagged (measured: 1-3
            # blocks over the model, by load). The gradient is flat already: all-reduce it in
            # place, the same reduction without the copy, and take this rank's slice.
            work = dist.all_reduce(full_grad, op=dist.ReduceOp.SUM, group=self.group,
                                   async_op=True)
            whole = full_grad.storage_offset() == 0 and \
                full_grad.untyped_storage().nbytes() == full_grad.numel() * full_grad.element_size()

            def slice_out() -> None:
                out.copy_(full_grad[start:end])
                if consume and whole:  # (a view of a larger buffer is its owner's to free)
                    # Freed here, not when the last reference goes: gloo's worker thread
                    # holds the finished collective, and the buffer, until it next runs.
                    full_grad.untyped_storage().resize_(0)

            return Pending([work], out, "reduce_scatter", self.stats, finish=slice_out)
        largest = max(sizes)
        if all(s == largest for s in sizes):
            work = dist.reduce_scatter_tensor(out, full_grad, group=self.group, async_op=True)
            return Pending([work], out, "reduce_scatter", self.stats)
        padded = torch.zeros(self.world_size, largest, dtype=full_grad.dtype,
                             device=full_grad.device)
        for r, (s, e) in enumerate(bounds):
            padded[r, :e - s].copy_(full_grad[s:e])
        padded_out = torch.empty(largest, dtype=full_grad.dtype, device=full_grad.device)
        work = dist.reduce_scatter_tensor(padded_out, padded.view(-1), group=self.group,
                                          async_op=True)

        def copy_out() -> None:
            out.copy_(padded_out[:end - start])

        return Pending([work], out, "reduce_scatter", self.stats, finish=copy_out)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Blocking SUM all-reduce of a small tensor (once per step: grad-norm, loss, and what
        rides along — every rank's timings, the trainer's stop and checkpoint votes)."""
        self._count("all_reduce", -1, values.numel())
        if self.world_size > 1:
            self.stats.native_calls["all_reduce"] += 1
            started = time.perf_counter()
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
            self.stats.wait_seconds["all_reduce"] += time.perf_counter() - started
        return values

    def _count(self, kind: str, unit: int, numel: int) -> None:
        self.stats.calls[kind] += 1
        self.stats.elements[kind] += numel
        self.stats.log.append((kind, unit))
