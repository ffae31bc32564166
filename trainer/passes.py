"""The engine's passes over its units: a training step's forward and backward, in recompute
mode (optionally keeping the graphs of the rank's last blocks) or keeping everything, and the
evaluation forward.

Split from `cephalo.trainer.engine`, which owns the state, the optimizer step and the public
API and explains the step; every function here takes the `Engine` whose units, activation
store and collectives it drives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from cephalo.trainer.collectives import Pending
from cephalo.trainer.unit_ops import (
    autocast,
    backward_unit,
    forward_unit,
    free_storage,
    head_forward_backward,
    restore_storage,
)

if TYPE_CHECKING:
    from cephalo.trainer.engine import Engine

Graph = tuple[torch.Tensor, torch.Tensor]  # one microbatch's (input, output) through a unit


def evaluate(engine: Engine, xs: list[torch.Tensor], targets: list[torch.Tensor]
             ) -> tuple[float, int]:
    """`Engine.evaluate`'s pass: (Σ per-sample loss, samples) over every rank."""
    units, device, precision = engine.units, engine.device, engine.precision
    last = len(units) - 1
    pending = engine._gather(0)
    for u in range(last):
        full = pending.wait()
        pending = engine._gather(u + 1)
        with engine._dilated():
            xs = forward_unit(units[u], full, xs, device, precision)
        release(engine, u, full)
        del full
    head = units[last]
    full = pending.wait()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    head.bind(full)
    with torch.no_grad(), autocast(device, precision), engine._dilated():
        for x, t in zip(xs, targets, strict=True):
            loss_sum += head.module(x, t).double().sum()
    head.unbind()
    release(engine, last, full)
    count = torch.tensor(float(sum(int(t.shape[0]) for t in targets)),
                         dtype=torch.float64, device=device)
    totals = engine.comm.all_reduce_sum(torch.stack([loss_sum, count])).cpu().tolist()
    engine.comm.stats.settle()  # the stream has passed every wait: its result is here
    return float(totals[0]), round(totals[1])


def head(engine: Engine, full: torch.Tensor, targets: list[torch.Tensor]
         ) -> tuple[torch.Tensor, Pending]:
    """Fused head forward+backward; puts input gradients in the store; issues its RS."""
    scatters: list[Pending] = []

    def issue(u: int, grad: torch.Tensor) -> Pending:
        scatters.append(engine._reduce_scatter(u, grad))
        return scatters[-1]

    last = len(engine.units) - 1
    gathered = Pending([], full, "all_gather", engine.comm.stats, done=True)
    return fused_tail(engine, last, gathered, targets, issue), scatters[0]


def fused_tail(engine: Engine, first: int, first_gather: Pending,
               targets: list[torch.Tensor], issue: Callable[[int, torch.Tensor], Pending]
               ) -> torch.Tensor:
    """Run every microbatch forward through units `first`..head and straight back: one
    microbatch's graphs alive at a time, parameter gradients accumulating over them (a
    block's in place, parameter by parameter: FlatUnit.bind_leaves). `first_gather` is unit
    `first`'s gather; the others are issued now (the tail holds them all anyway) and each
    waited for where the first microbatch needs it. The gradient of the tail's input goes in
    the store. `issue(u, gradient)` is called for every tail unit, last first, as soon as its
    gradient is final: during the last microbatch's backward, so that its reduce-scatter runs
    under the rest of it (FSDP2 does the same), in the same order on every rank. Returns the
    sum of per-sample losses."""
    units, store = engine.units, engine.store
    last = len(units) - 1
    if not targets:
        return _tail_without_samples(engine, first, first_gather, issue)
    blocks = last - first
    gathers = [first_gather, *(engine._gather(u) for u in range(first + 1, last + 1))]
    fulls: list[torch.Tensor | None] = [None] * len(gathers)
    grads: list[torch.Tensor] = []  # the blocks' full gradients
    leaves: list[list[torch.Tensor]] = []  # the blocks' parameters

    def gathered(i: int) -> torch.Tensor:
        if fulls[i] is None:
            full = gathers[i].wait()
            if i < blocks:
                grads.append(torch.zeros_like(full))
                leaves.append(units[first + i].bind_leaves(full, grads[i]))
            fulls[i] = full
        return fulls[i]  # type: ignore[return-value]

    issued = _InOrder(last, first, issue)
    loss_sum = torch.zeros((), dtype=torch.float32, device=engine.device)
    weight = engine.loss_weight  # 1/B, times the loss scale on an fp16 rank
    num_mb = len(targets)
    for mb, t in enumerate(targets):
        final = mb == num_mb - 1
        x = store.get((first, mb))
        hooks = _ready_hooks(engine, first, blocks, gathered, leaves, grads, issued) \
            if final else []
        with engine._dilated():
            if blocks:
                x = x.detach().requires_grad_(True)
                with torch.enable_grad(), autocast(engine.device, engine.precision):
                    y = x
                    for i in range(blocks):
                        gathered(i)  # the first microbatch waits for it and binds it
                        y = units[first + i].module(y)
            else:
                y = x
            losses, grad = head_forward_backward(units[last], gathered(blocks), y, t, weight,
                                                 engine.device, engine.precision)
            if final:
                issued.ready(last, grad_of(gathered(blocks)))
            if blocks:
                torch.autograd.backward(y, grad)
                assert x.grad is not None
                grad = x.grad
        for hook in hooks:
            hook.remove()
        loss_sum += losses.float()
        del x, y  # this microbatch's graphs go now
        store.drop((first, mb))
        store.put(("grad", first, mb), grad)
        store.evict(("grad", first, mb))
    for i in range(blocks):  # every gradient is final now, reached by a hook or not
        units[first + i].unbind()
        issued.ready(first + i, grads[i])
    for i, full in enumerate(fulls):
        if full is not None:
            release(engine, first + i, full)
    return loss_sum


def _ready_hooks(engine: Engine, first: int, blocks: int,
                 gathered: Callable[[int], torch.Tensor], leaves: list[list[torch.Tensor]],
                 grads: list[torch.Tensor], issued: _InOrder) -> list[Any]:
    """Hooks that tell `issued` when a block's gradient is final in the last microbatch:
    once autograd has added into every one of its parameters."""
    handles = []
    for i in range(blocks):
        gathered(i)
        pending = [len(leaves[i])]

        def added(_: torch.Tensor, i: int = i, pending: list[int] = pending) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                issued.ready(first + i, grads[i])

        handles += [leaf.register_post_accumulate_grad_hook(added) for leaf in leaves[i]]
    return handles


def _tail_without_samples(engine: Engine, first: int, pending: Pending,
                          issue: Callable[[int, torch.Tensor], Pending]) -> torch.Tensor:
    """A rank without samples takes part in the tail's collectives, in the same order, one
    unit buffer at a time (it computes nothing: holding the tail would only cost memory)."""
    last = len(engine.units) - 1
    for u in range(first, last + 1):
        release(engine, u, pending.wait())
        pending.release()  # the caller may hold the first one still
        if u < last:
            pending = engine._gather(u + 1)
    for u in range(last, first - 1, -1):
        issue(u, engine.master_shards[u].new_zeros(engine.units[u].numel)).wait()
    return torch.zeros((), dtype=torch.float32, device=engine.device)


class _InOrder:
    """Calls `issue(u, gradient)` for units last, last-1, ..., first, each once its gradient
    is ready: autograd may finish them in another order, the collectives must not differ."""

    def __init__(self, last: int, first: int, issue: Callable[[int, torch.Tensor], Pending]
                 ) -> None:
        self._next, self._first, self._issue = last, first, issue
        self._ready: dict[int, torch.Tensor] = {}

    def ready(self, u: int, grad: torch.Tensor) -> None:
        """Unit `u`'s gradient is final (again: ignored)."""
        if u <= self._next:
            self._ready.setdefault(u, grad)
        while self._next >= self._first and self._next in self._ready:
            self._issue(self._next, self._ready.pop(self._next))
            self._next -= 1


def grad_of(full: torch.Tensor) -> torch.Tensor:
    # A rank with no batch contributes zeros (it still takes part in the collective).
    return full.grad if full.grad is not None else torch.zeros_like(full)


def release(engine: Engine, u: int, full: torch.Tensor) -> None:
    """Free gathered unit buffer `full` now, when the pass is done with it. Dropping the last
    Python reference is not enough: gloo's worker thread keeps the finished collective, and
    with it the buffer, until it next runs (measured: 15-30 % of async collectives outlive
    `wait()` plus `del`, longer under load), so the buffer would stay allocated into the next
    unit's peak by chance, beyond the memory model's five unit buffers."""
    if full.untyped_storage().size() and _owns_storage(engine, u, full):
        free_storage(full)


def _owns_storage(engine: Engine, u: int, full: torch.Tensor) -> bool:
    """False when the gather handed out the master shard itself (one rank: an alias, see
    UnevenCollectives.all_gather), whose storage must never be freed. Only for a live
    `full`: a freed storage's address is null, as is an empty shard's."""
    master = engine.slices[u]
    return full.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()


def forward_backward_recompute(engine: Engine, inputs: list[torch.Tensor],
                               targets: list[torch.Tensor]
                               ) -> tuple[torch.Tensor, list[Pending]]:
    """Recompute mode. The rank's last `engine.kept_blocks` blocks keep their autograd graphs
    to the backward instead (no recompute). Of those, the last `engine.fused_tail` (the same
    on every rank) run per microbatch with the head and are gathered once; the others free
    their gathered parameters after the forward and refill them from the backward's gather,
    so the collectives are the same whatever each rank keeps beyond the common tail."""
    units, store = engine.units, engine.store
    last = len(units) - 1
    num_mb = len(inputs)
    first_fused = last - engine.fused_tail  # units first_fused..last run per microbatch
    first_kept = last - engine.kept_blocks  # first_kept..first_fused-1 keep layered graphs
    graphs: dict[int, list[Graph]] = {}
    kept: dict[int, torch.Tensor] = {}  # a kept unit's gathered buffer
    freed: set[int] = set()  # kept units whose buffer's storage was freed (all but aliases)
    pending = engine._gather(0)
    for u in range(first_fused):
        full = pending.wait()
        pending = engine._gather(u + 1)  # prefetch while this unit computes
        if u >= first_kept:
            graphs[u] = _forward_kept(engine, u, full, num_mb)
            if _owns_storage(engine, u, full):
                free_storage(full)  # the graphs keep views, the memory goes
                freed.add(u)
            kept[u] = full
            del full
            continue
        xs = inputs if u == 0 else [store.get((u, mb)) for mb in range(num_mb)]
        with engine._dilated():
            ys = forward_unit(units[u], full, xs, engine.device, engine.precision)
        for mb, y in enumerate(ys):
            if u > 0:
                store.evict((u, mb))  # consumed; needed again only in backward
            store.put((u + 1, mb), y)
        release(engine, u, full)
        del full
    # The tail is gathered once for the step (its first unit prefetched under the last
    # layered one); without a fused tail it is the head alone.
    tail_gather = pending
    if first_fused == last and last >= 1:
        pending = engine._gather(last - 1)  # first unit of the backward, under the head
    scatters: list[Pending] = []

    def issue(u: int, grad: torch.Tensor) -> Pending:
        nonlocal pending
        if u == first_fused < last:
            # In recompute mode's order less the skipped gathers, and only as the tail's last
            # backward ends (every tail gradient final): its buffer takes the place of a
            # microbatch gradient being added (cephalo.api.memory.fused_tail_bytes).
            pending = engine._gather(u - 1)
        scatters.append(engine._reduce_scatter(u, grad))
        return scatters[-1]

    loss_sum = fused_tail(engine, first_fused, tail_gather, targets, issue)
    del tail_gather  # the parameters go; the gradients wait for their reduce-scatters
    for u in range(first_fused - 1, -1, -1):
        full = pending.wait()
        if u in kept:
            if u in freed:
                restore_storage(kept[u], full)
                release(engine, u, full)  # the re-gathered copy
            full = kept.pop(u)
            # The re-gathered buffer (held by `pending` too) goes before the next gather
            # allocates: at most five unit buffers (cephalo.api.memory).
            del pending
        if u >= 1:
            pending = engine._gather(u - 1)
        engine._prefetch_backward(u, 0, num_mb)
        if u in graphs:
            _backward_kept(engine, u, graphs.pop(u), num_mb)
        else:
            _backward_recompute(engine, u, full, inputs, num_mb)
        # At most one reduce-scatter in flight, each holding a full unit gradient (one of
        # the memory model's unit buffers, cephalo.api.memory): the previous unit's has
        # had this unit's backward to finish, as the cost model assumes.
        scatters[-1].wait()
        scatters.append(engine._reduce_scatter(u, grad_of(full)))
        release(engine, u, full)
        del full
    store.clear()
    return loss_sum, scatters[::-1]


def _backward_recompute(engine: Engine, u: int, full: torch.Tensor,
                        inputs: list[torch.Tensor], num_mb: int) -> None:
    store = engine.store
    for mb in range(num_mb):
        # Bring the next microbatch's tensors back while this one computes.
        engine._prefetch_backward(u, mb + 1, num_mb)
        x = inputs[mb] if u == 0 else store.get((u, mb))
        grad_y = store.get(("grad", u + 1, mb))
        with engine._dilated():
            grad_x = backward_unit(engine.units[u], full, x, grad_y, engine.device,
                                   engine.precision, needs_input_grad=u > 0)
        store.drop(("grad", u + 1, mb))
        store.drop((u, mb))
        if grad_x is not None:
            store.put(("grad", u, mb), grad_x)
            store.evict(("grad", u, mb))


def _forward_kept(engine: Engine, u: int, full: torch.Tensor, num_mb: int) -> list[Graph]:
    """Forward of kept block `u` over every microbatch with autograd: the graphs reach the
    gathered parameters through views of `full`."""
    unit, store = engine.units[u], engine.store
    full.requires_grad_(True)
    graphs = []
    unit.bind(full)  # views created with autograd on: the graphs reach `full`
    with torch.enable_grad(), autocast(engine.device, engine.precision), engine._dilated():
        for mb in range(num_mb):
            x = store.get((u, mb)).detach().requires_grad_(True)
            y = unit.module(x)
            graphs.append((x, y))
            store.drop((u, mb))  # the graph holds it now: neither offloaded nor kept twice
            store.put((u + 1, mb), y.detach())
    unit.unbind()
    return graphs


def _backward_kept(engine: Engine, u: int, graphs: list[Graph], num_mb: int) -> None:
    """Back-propagate every microbatch through kept block `u` (parameters restored): the
    parameter gradient accumulates in the full buffer's `.grad`; each graph is released as
    soon as it is done."""
    store = engine.store
    graphs.reverse()  # pop() hands them out in microbatch order
    for mb in range(num_mb):
        engine._prefetch_backward(u, mb + 1, num_mb)
        x, y = graphs.pop()
        grad_y = store.get(("grad", u + 1, mb))
        with engine._dilated():
            torch.autograd.backward(y, grad_y)
        store.drop(("grad", u + 1, mb))
        assert x.grad is not None
        store.put(("grad", u, mb), x.grad)
        store.evict(("grad", u, mb))
        del x, y, grad_y  # this microbatch's input and output go now


def forward_backward_keep(engine: Engine, inputs: list[torch.Tensor],
                          targets: list[torch.Tensor]) -> tuple[torch.Tensor, list[Pending]]:
    """Layered accumulation without recompute: graphs and gathered units stay alive."""
    units, store = engine.units, engine.store
    last = len(units) - 1
    num_mb = len(inputs)
    graphs: list[list[Graph]] = []
    fulls: list[torch.Tensor] = []
    pending = engine._gather(0)
    for u in range(last):
        full = pending.wait().requires_grad_(True)
        pending = engine._gather(u + 1)
        units[u].bind(full)
        unit_graphs = []
        with torch.enable_grad(), autocast(engine.device, engine.precision), \
                engine._dilated():
            for mb in range(num_mb):
                x = inputs[mb] if u == 0 else store.get((u, mb)).requires_grad_(True)
                y = units[u].module(x)
                unit_graphs.append((x, y))
                store.put((u + 1, mb), y.detach())
        units[u].unbind()
        graphs.append(unit_graphs)
        fulls.append(full)
    loss_sum, head_rs = head(engine, pending.wait(), targets)
    scatters = [head_rs]
    for u in range(last - 1, -1, -1):
        for mb, (x, y) in enumerate(graphs[u]):
            with engine._dilated():
                torch.autograd.backward(y, store.get(("grad", u + 1, mb)))
            store.drop(("grad", u + 1, mb))
            if u > 0:
                store.put(("grad", u, mb), x.grad)
        graphs[u] = []
        scatters.append(engine._reduce_scatter(u, grad_of(fulls[u])))
        release(engine, u, fulls[u])
        fulls[u] = torch.empty(0)
    store.clear()
    return loss_sum, scatters[::-1]
