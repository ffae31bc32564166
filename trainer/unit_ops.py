"""The per-unit compute the engine runs, the activation store, and a profiler entry point.

These are the *only* code paths that run a unit: the engine's layered schedule calls
`forward_unit` / `backward_unit` for every unit, and the profiler (`cephalo.trainer.profile`)
times the very same two functions, so profiled times are the engine's times;
`run_unit_for_profile` is the same measurement for one block on its own.

Activation checkpointing is at unit boundaries: forward runs without autograd and keeps
only each unit's inputs (one tensor per microbatch); backward re-runs the unit with
autograd, one microbatch at a time, and back-propagates the boundary gradient. A rank may
keep some blocks' graphs instead (`free_storage` / `restore_storage`: their parameters are
freed after the forward and gathered again for the backward all the same).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.precision import autocast as autocast  # re-exported


class ActivationStore:
    """Boundary activations (and their gradients) by key, optionally offloaded to host.

    On CUDA, `evict` copies to pinned host memory on a side stream while compute continues
    and `prefetch` brings a tensor back on that stream ahead of use; `get` makes the compute
    stream wait only for that one copy. Without CUDA the same calls do plain copies, so the
    bookkeeping is exercised by the CPU tests.
    """

    def __init__(self, device: torch.device, offload: bool) -> None:
        self.device = device
        self.offload = offload
        self._device: dict[Hashable, torch.Tensor] = {}
        self._host: dict[Hashable, torch.Tensor] = {}
        self._events: dict[Hashable, object] = {}
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if self._cuda and offload else None
        self.offloaded_bytes = 0

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        self._device[key] = tensor

    def evict(self, key: Hashable) -> None:
        """Move `key` to host memory (no-op without offload)."""
        if not self.offload or key not in self._device:
            return
        tensor = self._device.pop(key)
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if self._stream is None:
            self._host[key] = tensor.detach().to("cpu", copy=True)
            return
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
            # The caching allocator must not reuse the GPU block before the copy finished.
            tensor.record_stream(self._stream)
        self._host[key] = host

    def prefetch(self, key: Hashable) -> None:
        """Start bringing `key` back to the device (no-op when it is there)."""
        if key not in self._host:
            return
        host = self._host.pop(key)
        if self._stream is None:
            self._device[key] = host.to(self.device, copy=True)
            return
        # Host data must be complete before the copy back reads it (same stream: ordered).
        with torch.cuda.stream(self._stream):
            tensor = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._device[key] = tensor
        self._events[key] = event

    def get(self, key: Hashable) -> torch.Tensor:
        if key not in self._device:
            self.prefetch(key)
        event = self._events.pop(key, None)
        tensor = self._device[key]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor

    def drop(self, key: Hashable) -> None:
        self._device.pop(key, None)
        self._host.pop(key, None)
        self._events.pop(key, None)

    def clear(self) -> None:
        self._device.clear()
        self._host.clear()
        self._events.clear()


def forward_unit(unit: FlatUnit, full: torch.Tensor, inputs: list[torch.Tensor],
                 device: torch.device, precision: str) -> list[torch.Tensor]:
    """Checkpointed forward of one non-head unit over microbatches: no autograd state."""
    unit.bind(full)
    outputs = []
    with torch.no_grad(), autocast(device, precision):
        for x in inputs:
            outputs.append(unit.module(x))
    unit.unbind()
    return outputs


def backward_unit(unit: FlatUnit, full: torch.Tensor, x: torch.Tensor,
                  grad_output: torch.Tensor, device: torch.device, precision: str,
                  needs_input_grad: bool) -> torch.Tensor | None:
    """Recompute one microbatch through `unit` and back-propagate `grad_output`.

    The parameter gradient accumulates into ``full.grad`` (the flat buffer); returns the
    gradient of the unit's input (None for the embedding unit, whose input is data).
    """
    if not full.requires_grad:
        full.requires_grad_(True)
    if needs_input_grad:
        x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        unit.bind(full)  # views created with autograd on, per microbatch (fresh graph)
        with autocast(device, precision):
            y = unit.module(x)
        torch.autograd.backward(y, grad_output)
    unit.unbind()
    return x.grad if needs_input_grad else None


def free_storage(full: torch.Tensor) -> None:
    """Free a gathered unit buffer whose views a kept autograd graph still holds (FSDP1 frees
    its unsharded flat parameter the same way): the graph keeps the tensor's metadata, the
    memory goes. `restore_storage` brings the values back before the graph's backward."""
    full.untyped_storage().resize_(0)


def restore_storage(full: torch.Tensor, regathered: torch.Tensor) -> None:
    """Refill `full`'s freed storage from a fresh gather of the same unit.

    A storage-level copy: it leaves the version counter that autograd checks on saved
    tensors untouched, where ``full.copy_`` would bump it and make the kept graph's backward
    raise (tests/trainer/test_kept_blocks.py shows both)."""
    source = regathered.untyped_storage()
    # Both are whole fresh gathers of the unit (collectives.py): same layout, byte for byte.
    if (regathered.storage_offset(), regathered.dtype, source.nbytes()) != (
            full.storage_offset(), full.dtype, full.numel() * full.element_size()):
        raise RuntimeError("a kept unit's buffer and its re-gather differ in layout")
    storage = full.untyped_storage()
    storage.resize_(source.nbytes())
    storage.copy_(source)


def head_forward_backward(unit: FlatUnit, full: torch.Tensor, x: torch.Tensor,
                          targets: torch.Tensor, loss_weight: float, device: torch.device,
                          precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The head runs forward and backward at once (nothing to recompute): returns the sum of
    per-sample losses (detached) and the gradient of the head's input.

    `loss_weight` is 1/B for the global batch B, so gradients summed over all ranks are the
    gradient of the mean loss over B.
    """
    if not full.requires_grad:
        full.requires_grad_(True)
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        unit.bind(full)
        with autocast(device, precision):
            losses = unit.module(x, targets)
        (losses.sum() * loss_weight).backward()
    unit.unbind()
    assert x.grad is not None
    return losses.detach().sum(), x.grad


@dataclass(frozen=True)
class BlockTiming:
    micro_batch_size: int
    forward_seconds: float  # one checkpointed forward of one block
    backward_seconds: float  # recompute + backward of one block
    peak_memory_bytes: int | None  # CUDA only


def run_unit_for_profile(block: nn.Module, hidden: torch.Tensor, device: torch.device,
                         precision: str = "fp32", repeats: int = 3,
                         warmup: int = 1) -> BlockTiming:
    """Time ONE block's forward and backward-with-recompute on one microbatch `hidden`
    ([m, S, H] on `device`) through the engine's own `forward_unit` / `backward_unit`.

    `block` is e.g. ``build_model(config).units[1].to(device)``; its parameters are moved
    into a flat buffer as the engine does. Returns median seconds over `repeats` runs after
    `warmup` runs, and the CUDA peak memory of the measured runs.
    """
    flat_unit = FlatUnit(1, block, [1.0], 0)
    full = flat_unit.flatten().to(device)
    flat_unit.detach_parameters()
    grad_output = torch.randn_like(hidden)
    is_cuda = device.type == "cuda"

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize(device)

    forward_times, backward_times = [], []
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + repeats):
        sync()
        started = time.perf_counter()
        (out,) = forward_unit(flat_unit, full, [hidden], device, precision)
        sync()
        mid = time.perf_counter()
        backward_unit(flat_unit, full, hidden, grad_output.to(out.dtype), device, precision,
                      needs_input_grad=True)
        sync()
        ended = time.perf_counter()
        full.grad = None
        if i >= warmup:
            forward_times.append(mid - started)
            backward_times.append(ended - mid)
    peak = torch.cuda.max_memory_allocated(device) if is_cuda else None
    return BlockTiming(hidden.shape[0], sorted(forward_times)[len(forward_times) // 2],
                       sorted(backward_times)[len(backward_times) // 2], peak)
