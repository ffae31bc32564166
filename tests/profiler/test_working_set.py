"""The profile's compute memory counts a unit's input once, on the CPU and on a GPU alike
(issue 43, item 6): on a GPU the input was allocated before the allocator's peak was reset,
so the peak alone left it out; on the CPU the input was counted both as a saved tensor (a
norm saves it) and as a boundary tensor, and the unit's flat buffer (counted apart among
the unit buffers) once more as a saved tensor."""

from __future__ import annotations

import pytest
import torch

from cephalo.api import memory, preset
from cephalo.trainer.profile_units import UnitProfiler, saved_graph_bytes
from cephalo.trainer.unit_ops import forward_unit

M = 4
# vocab 16: the head's logits stay smaller than a block's graph, so a block's working set
# is the larger one and the figure below is the block's.
CONFIG = preset("gpt-tiny").model_copy(update={"vocab_size": 16})


def _case() -> tuple[UnitProfiler, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    profiler = UnitProfiler(CONFIG, "fp32", torch.device("cpu"))
    inputs, targets = profiler.data.batch(0, 0, M)
    (hidden,) = forward_unit(profiler.units[0], profiler.fulls[0], [inputs], profiler.device,
                             "fp32")
    return profiler, inputs, targets, hidden


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_cpu_counts_the_block_input_once() -> None:
    """The block's saved graph (its input among it: the first norm saves it), plus the
    output gradient and the input gradient, each the input's size."""
    profiler, inputs, targets, hidden = _case()
    graph = saved_graph_bytes(profiler.units[1], profiler.fulls[1], hidden, profiler.device,
                              "fp32")
    assert graph > _nbytes(hidden)  # the input is in it (or the oracle would be off)
    fixed = memory.unit_buffer_bytes(profiler.max_unit_parameters)
    got = profiler.compute_memory_bytes(M, inputs, targets, hidden)
    assert got - fixed == graph + 2 * _nbytes(hidden)


def test_gpu_counts_the_block_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake CUDA allocator whose peak during any step is `PEAK` bytes above what was
    allocated before it: the working set is that plus the input, which the allocator held
    already (the steps run on the CPU: fp32 autocast is no autocast on any device)."""
    profiler, inputs, targets, hidden = _case()
    peak = 123_456
    allocated = {"now": 10**9, "peak": 10**9}

    def reset(device: object = None) -> None:
        allocated["peak"] = allocated["now"] + peak  # what the next step will reach

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: allocated["peak"])
    profiler.device = torch.device("cuda", 0)
    fixed = memory.unit_buffer_bytes(profiler.max_unit_parameters)
    got = profiler.compute_memory_bytes(M, inputs, targets, hidden)
    assert got - fixed == peak + _nbytes(hidden)
