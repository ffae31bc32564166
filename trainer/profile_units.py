"""Unit timings and compute memory of one model on one device, through the engine's own
unit functions: the measuring core of the profiler (`cephalo.trainer.profile`)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cephalo.api.memory import unit_buffer_bytes
from cephalo.api.models import ModelConfig
from cephalo.api.profile import ProfilePoint
from cephalo.trainer.data import DataSource
from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.models import build_unit
from cephalo.trainer.unit_ops import (
    autocast,
    backward_unit,
    forward_unit,
    head_forward_backward,
)


def measured_units(config: ModelConfig) -> tuple[int, int, int]:
    """The units a profile runs: the embedding, the first block and the head."""
    return (0, 1, config.num_layers + 1)


def _once_per_pass(med: dict[tuple[str, int], float], series: str, sizes) -> float:
    """The part of a one-microbatch pass that a second microbatch does not repeat:
    t1 - (t2 - t1) per size, the median over sizes, within [0, the smallest t1]."""
    fixed = statistics.median(2 * med[f"{series}1", m] - med[f"{series}2", m] for m in sizes)
    return min(max(0.0, fixed), min(med[f"{series}1", m] for m in sizes))


class SavedBytes:
    """Counts the distinct storage bytes autograd saves for backward, by storage address
    (only storages on `device_type` when given: e.g. not a CUDA kernel's host-side RNG
    state). Read while the graph is alive: a freed address may be reused."""

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type
        self.storages: dict[int, int] = {}  # address -> bytes

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device_type is None or tensor.device.type == self.device_type:
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def saved_graph_bytes(unit: FlatUnit, full: torch.Tensor, x: torch.Tensor,
                      device: torch.device, precision: str) -> int:
    """Bytes of the distinct storages on `device` that autograd saves for the backward of
    one forward of `unit` over the microbatch `x`, the unit's own parameters and buffers not
    counted.

    Run as the engine runs a block whose graph it keeps (`unit.bind` of the flat buffer with
    autograd on, the input a leaf that needs its gradient): the parameters are views of the
    flat buffer, which the engine holds (or frees and gathers again) whatever the graph
    keeps, so its storage is left out. The input is counted when the graph saves it (it does:
    a norm's input): a kept graph holds it on the device, offloaded or not. Storages are told
    apart by address while the graph, and so every saved tensor, is alive."""
    saved = SavedBytes(device.type)
    flat = full.detach().requires_grad_(True)  # same storage, a leaf as the engine's
    with torch.enable_grad(), saved.hooks():
        unit.bind(flat)
        with autocast(device, precision):
            output = unit.module(x.detach().requires_grad_(True))
        unit.unbind()
    # The module's buffers (e.g. RoPE tables) stay with the module whatever the graph keeps.
    for own in (flat, *unit.module.buffers()):
        saved.storages.pop(own.untyped_storage().data_ptr(), None)
    total = saved.bytes
    del output  # the graph, and the storages it saved, only now
    return total


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Measured:
    """What `UnitProfiler.measure` found: one point per microbatch size, and the parts of a
    forward pass paid once per unit pass whatever the number of microbatches."""

    points: list[ProfilePoint]
    block_forward_fixed_seconds: float
    other_forward_fixed_seconds: float
    extra_seconds: dict[str, float]  # median of each extra run (see `measure`)
    block_graph_bytes_per_sample: float  # UnitProfiler.block_graph_bytes_per_sample


class UnitProfiler:
    """Times the units of one model on one device through the engine's unit functions."""

    def __init__(self, config: ModelConfig, precision: str, device: torch.device,
                 seed: int = 0) -> None:
        self.config = config
        self.precision = precision
        self.device = device
        self.units = []
        self.fulls = []
        # Profile the embedding, the first block and the head; blocks are identical. Only
        # these are built (each unit is seeded on its own, so they are the model's units):
        # drawing a large model's every block on the CPU costs most of a profile's time
        # (gpt-1.3b: about 55 s of 70 on an H100's host).
        for index in measured_units(config):
            flat = FlatUnit(index, build_unit(config, index, seed), [1.0], 0)
            self.fulls.append(flat.flatten().to(device))
            flat.detach_parameters()
            flat.module.to(device)
            self.units.append(flat)
        from cephalo.api.job import DataSpec, SyntheticData

        self.data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed)
        self.max_unit_parameters = max(u.numel for u in self.units)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn: Callable[[], object]) -> float:
        self._sync()
        started = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - started

    def measure(self, sizes: Sequence[int], repeats: int, warmup: int,
                extra: dict[str, Callable[[], object]] | None = None) -> Measured:
        """Median seconds per microbatch size of a block's forward and recompute+backward,
        and of the embedding + data + head + loss, as the engine runs them.

        Repeats go round-robin over the sizes, so that a machine whose speed drifts (clock
        boost, a neighbour on a shared core) shifts every size alike instead of bending the
        curve. Forward passes run once with one microbatch and once with two: the engine
        runs all of a rank's microbatches through a unit in one pass, so what the second
        microbatch adds is the per-microbatch cost and the rest is paid once per pass.
        `extra` runs are timed once per round too, so they see the same drift."""
        emb, block, head = self.units
        emb_full, block_full, head_full = self.fulls
        cases = {}
        for m in sorted(set(sizes)):
            inputs, targets = self.data.batch(0, 0, 2 * m)
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            xs, ts = [inputs[:m], inputs[m:]], [targets[:m], targets[m:]]
            hiddens = forward_unit(emb, emb_full, xs, self.device, self.precision)
            cases[m] = (xs, ts, hiddens, torch.ones_like(hiddens[0]))
        samples: dict[tuple[str, int], list[float]] = {}

        def block_forward(m: int, ell: int) -> None:
            forward_unit(block, block_full, cases[m][2][:ell], self.device, self.precision)

        def block_backward(m: int) -> None:
            _, _, hiddens, grad = cases[m]
            backward_unit(block, block_full, hiddens[0], grad, self.device, self.precision,
                          needs_input_grad=True)
            block_full.grad = None

        def other_forward(m: int, ell: int) -> None:
            self.data.micro_batches(0, 0, ell * m, m)  # the data a rank reads
            forward_unit(emb, emb_full, cases[m][0][:ell], self.device, self.precision)

        def other_backward(m: int) -> None:
            xs, ts, hiddens, _ = cases[m]
            _, grad = head_forward_backward(head, head_full, hiddens[0], ts[0], 1.0 / m,
                                            self.device, self.precision)
            backward_unit(emb, emb_full, xs[0], grad, self.device, self.precision,
                          needs_input_grad=False)
            head_full.grad = None
            emb_full.grad = None

        runs: list[tuple[str, Callable[[int], None]]] = [
            ("bf1", lambda m: block_forward(m, 1)), ("bf2", lambda m: block_forward(m, 2)),
            ("bb", block_backward),
            ("of1", lambda m: other_forward(m, 1)), ("of2", lambda m: other_forward(m, 2)),
            ("ob", other_backward)]
        for i in range(warmup + repeats):
            for m in cases:
                for name, run in runs:
                    seconds = self._timed(functools.partial(run, m))
                    if i >= warmup:
                        samples.setdefault((name, m), []).append(seconds)
            for name, fn in (extra or {}).items():
                seconds = self._timed(fn)
                if i >= warmup:
                    samples.setdefault((name, 0), []).append(seconds)
        med = {key: statistics.median(values) for key, values in samples.items()}
        points = [ProfilePoint(
            micro_batch_size=m, block_forward_seconds=med["bf1", m],
            block_backward_seconds=med["bb", m], other_forward_seconds=med["of1", m],
            other_backward_seconds=med["ob", m],
            compute_memory_bytes=self.compute_memory_bytes(m, cases[m][0][0], cases[m][1][0],
                                                           cases[m][2][0]))
            for m in cases]
        smallest = min(cases)
        return Measured(points, _once_per_pass(med, "bf", cases), _once_per_pass(med, "of", cases),
                        {name: med[name, 0] for name in extra or {}},
                        self.block_graph_bytes_per_sample(smallest, cases[smallest][2]))

    def block_graph_bytes_per_sample(self, m: int, hiddens: Sequence[torch.Tensor] | None = None
                                     ) -> float:
        """What keeping one block's autograd graph costs per sample at microbatch size m
        (`saved_graph_bytes` over a microbatch of m and one of 2m samples).

        The per-sample slope is the activations. What a microbatch holds whatever its size
        comes on top: under bf16 autocast the graph saves a bf16 copy of each weight matrix,
        made by every forward call, so each microbatch's graph holds one (2 bytes per element
        of the block's matrices; fp32 saves no parameter copy). The engine runs a rank's
        microbatches through a block one forward call each, so the figure is the slope plus
        that part shared by the m samples: exact at m, an overstatement at larger
        microbatches, never less than a kept graph holds at m or above. `hiddens`: two
        microbatches of m block inputs (made from the data when not given)."""
        if hiddens is None:
            inputs, _ = self.data.batch(0, 0, 2 * m)
            inputs = inputs.to(self.device)
            hiddens = forward_unit(self.units[0], self.fulls[0], [inputs[:m], inputs[m:]],
                                   self.device, self.precision)
        block, full = self.units[1], self.fulls[1]
        one = saved_graph_bytes(block, full, hiddens[0], self.device, self.precision)
        two = saved_graph_bytes(block, full, torch.cat(list(hiddens[:2])), self.device,
                                self.precision)
        slope = (two - one) / m
        return max(slope, one / m)  # one / m = slope + (per-microbatch part) / m

    def compute_memory_bytes(self, m: int, inputs: torch.Tensor, targets: torch.Tensor,
                             hidden: torch.Tensor) -> int:
        """Peak bytes of a step beyond the training state, for microbatch size m.

        The gathered unit buffers at the engine's peak (cephalo.api.memory), plus the larger
        of a block's and the head's working set for one microbatch (they never overlap)."""
        fixed = unit_buffer_bytes(self.max_unit_parameters)
        return fixed + max(self.working_set_bytes(self._block_step, hidden),
                           self.working_set_bytes(
                               lambda h: self._head_step(h, targets, m), hidden))

    def working_set_bytes(self, step: Callable[[torch.Tensor], list[torch.Tensor]],
                          hidden: torch.Tensor) -> int:
        """Bytes a unit's step over the microbatch `hidden` holds at its peak, its input
        counted once on every device: the input (a block's or the head's, `hidden`) is on
        the device through the step whether the forward kept it there or offloaded it to
        the host and brought it back, so it belongs to the working set (with kept
        boundaries it is also among them: one microbatch's boundary over, on the safe
        side). On a GPU: the allocator's peak during the step beyond what was allocated
        before it (which holds `hidden`), plus `hidden`. On the CPU, which has no
        allocator statistics: the distinct storages autograd saves and the input, by
        address (a norm saves the input: one storage), the units' flat buffers and module
        buffers left out as on a GPU, where they were allocated before the step (the flat
        buffers are the unit buffers counted apart); plus the gradients the step returns
        (by size: one may take the address of a saved tensor freed before it)."""
        if self.device.type == "cuda":
            return _nbytes(hidden) + self._cuda_peak(lambda: step(hidden))
        counter = SavedBytes()
        with counter.hooks():
            gradients = step(hidden)
        counter.pack(hidden)  # alive throughout: its address is its own
        for unit, full in zip(self.units, self.fulls, strict=True):
            for own in (full, *unit.module.buffers()):
                counter.storages.pop(own.untyped_storage().data_ptr(), None)
        return counter.bytes + _nbytes(*gradients)

    def _block_step(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """A block's forward and recompute + backward over `hidden`; the gradients alive
        during the backward beside its input: the output's and the input's."""
        _, block, _ = self.units
        full = self.fulls[1]
        (out,) = forward_unit(block, full, [hidden], self.device, self.precision)
        grad_out = torch.ones_like(out)
        grad_in = backward_unit(block, full, hidden, grad_out, self.device, self.precision,
                                needs_input_grad=True)
        full.grad = None
        return [t for t in (grad_out, grad_in) if t is not None]

    def _head_step(self, hidden: torch.Tensor, targets: torch.Tensor, m: int
                   ) -> list[torch.Tensor]:
        """The head's forward and backward; the gradient of its input."""
        _, _, head = self.units
        full = self.fulls[2]
        _, grad = head_forward_backward(head, full, hidden, targets, 1.0 / m, self.device,
                                        self.precision)
        full.grad = None
        return [t for t in (grad,) if t is not None]

    def _cuda_peak(self, step: Callable[[], object]) -> int:
        """Peak bytes the CUDA allocator held during `step` beyond what it held before."""
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)
