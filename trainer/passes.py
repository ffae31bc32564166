"""The engine's passes over its units: a training step's forward and backward, in recompute
mode (optionally keeping the graphs of the rank's last blocks) or keeping everything, and the
evaluation forward.

Split from `cephalo.trainer.engine`, which owns the state, the optimizer step and the public
API and explains the step; every function here takes the `Engine` whose units, activation
store and collectives it drives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
        del full
    head = units[last]
    full = pending.wait()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    head.bind(full)
    with torch.no_grad(), autocast(device, precision), engine._dilated():
        for x, t in zip(xs, targets, strict=True):
            loss_sum += head.module(x, t).double().sum()
    head.unbind()
    count = torch.tensor(float(sum(int(t.shape[0]) for t in targets)),
                         dtype=torch.float64, device=device)
    totals = engine.comm.all_reduce_sum(torch.stack([loss_sum, count])).cpu().tolist()
    return float(totals[0]), round(totals[1])


def head(engine: Engine, full: torch.Tensor, targets: list[torch.Tensor]
         ) -> tuple[torch.Tensor, Pending]:
    """Fused head forward+backward; puts input gradients in the store; issues its RS."""
    store = engine.store
    unit = engine.units[-1]
    last = len(engine.units) - 1
    loss_sum = torch.zeros((), dtype=torch.float32, device=engine.device)
    weight = 1.0 / engine.layout.global_batch_size
    for mb, t in enumerate(targets):
        x = store.get((last, mb))
        with engine._dilated():
            losses, grad_x = head_forward_backward(unit, full, x, t, weight, engine.device,
                                                   engine.precision)
        loss_sum += losses.float()
        store.drop((last, mb))
        store.put(("grad", last, mb), grad_x)
        store.evict(("grad", last, mb))
    return loss_sum, engine.comm.reduce_scatter(grad_of(full), unit.bounds, last)


def grad_of(full: torch.Tensor) -> torch.Tensor:
    # A rank with no batch contributes zeros (it still takes part in the collective).
    return full.grad if full.grad is not None else torch.zeros_like(full)


def _owns_storage(engine: Engine, u: int, full: torch.Tensor) -> bool:
    """False when the gather handed out the master shard itself (one rank: an alias, see
    UnevenCollectives.all_gather), whose storage must never be freed. Only for a live
    `full`: a freed storage's address is null, as is an empty shard's."""
    master = engine.master_shards[u]
    return full.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()


def forward_backward_recompute(engine: Engine, inputs: list[torch.Tensor],
                               targets: list[torch.Tensor]
                               ) -> tuple[torch.Tensor, list[Pending]]:
    """Recompute mode. The rank's last `engine.kept_blocks` blocks keep their autograd graphs
    to the backward instead (no recompute) but free their gathered parameters after the
    forward and refill them from the backward's gather, so the collectives are the same
    whatever each rank keeps."""
    units, store = engine.units, engine.store
    last = len(units) - 1
    num_mb = len(inputs)
    first_kept = last - engine.kept_blocks  # units first_kept..last-1 keep their graphs
    graphs: dict[int, list[Graph]] = {}
    kept: dict[int, torch.Tensor] = {}  # a kept unit's gathered buffer
    freed: set[int] = set()  # kept units whose buffer's storage was freed (all but aliases)
    pending = engine._gather(0)
    for u in range(last):
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
        del full
    full = pending.wait()
    if last >= 1:
        pending = engine._gather(last - 1)  # first unit of the backward pass
    loss_sum, head_rs = head(engine, full, targets)
    scatters: list[Pending] = [head_rs]
    del full
    for u in range(last - 1, -1, -1):
        full = pending.wait()
        if u in kept:
            if u in freed:
                restore_storage(kept[u], full)
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
        scatters.append(engine.comm.reduce_scatter(grad_of(full), units[u].bounds, u))
        if u in freed:
            free_storage(full)
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
        scatters.append(engine.comm.reduce_scatter(grad_of(fulls[u]), units[u].bounds, u))
        fulls[u] = torch.empty(0)
    store.clear()
    return loss_sum, scatters[::-1]
