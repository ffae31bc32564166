"""The probe's and the profiler's code against a process group that refuses what NCCL
refuses (issue 43, item 1): NCCL has no CPU backend, so a tensor made without the group's
device and handed to a collective fails on every GPU job ("No backend type associated with
device type cpu") while gloo on the CPU takes it.

On a CPU machine the group's device and the default device are both the CPU, so the ranks
here tell them apart by provenance: a TorchFunctionMode marks every tensor a factory made
without `device=` (and every `.cpu()`), carries the mark through ops whose tensor inputs are
all marked (casts, views, cat, ...), drops it where `.to(device)` moves a tensor, and
torch.distributed's collectives refuse a marked tensor with NCCL's error. The static check
of the same class is tests/unit/test_collective_tensor_devices.py."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from cephalo.api.models import preset
from cephalo.trainer.spawn import spawn_ranks

NCCL_REFUSAL = "No backend type associated with device type cpu"
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace",
             "rand", "randn", "randint", "randperm", "eye", "scalar_tensor", "from_numpy")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single")


class HostTensors(TorchFunctionMode):
    """Marks the tensors that would be on the host on a GPU rank (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = {getattr(torch, name) for name in FACTORIES}
        # By id, each with a weak reference that tells a live tensor from a later one
        # at the same address (a tensor's == is element-wise: no set of tensors).
        self.marked: dict[int, weakref.ref[torch.Tensor]] = {}

    def is_host(self, value: Any) -> bool:
        ref = self.marked.get(id(value))
        return ref is not None and ref() is value

    def mark(self, tensors: list[torch.Tensor], host: bool) -> None:
        for t in tensors:
            if host:
                self.marked[id(t)] = weakref.ref(t)
            elif self.is_host(t):
                del self.marked[id(t)]

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if func in self.factories:
            host = kwargs.get("device") is None or func is torch.from_numpy
        elif name == "cpu":
            host = True
        elif name in ("to", "cuda"):
            moved = name == "cuda" or "device" in kwargs or any(
                isinstance(a, str | torch.device | torch.Tensor) for a in args[1:])
            if moved:
                # On a GPU this is a new tensor on the device; here `.to` may return its
                # input itself, which is on the device from now on.
                self.mark(outputs, host=False)
                return result
            host = self.is_host(args[0])
        elif name.endswith("_") or name == "__setitem__":
            return result  # in place: the tensor stays where it is
        else:
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            # All on the host: the result is too (a mix fails on a GPU or lands there).
            host = bool(inputs) and all(self.is_host(t) for t in inputs)
        if host:
            self.mark(outputs, host=True)
        return result


def _refusing(mode: HostTensors, collective: Callable) -> Callable:
    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if any(mode.is_host(t) for t in tree_flatten((args, kwargs))[0]):
            raise RuntimeError(NCCL_REFUSAL)
        return collective(*args, **kwargs)

    return call


def _as_nccl_would(run: Callable[[], Any]) -> Any:
    """`run()` with host tensors marked and the collectives refusing them."""
    mode = HostTensors()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, collective in originals.items():
        setattr(dist, name, _refusing(mode, collective))
    try:
        with mode:
            return run()
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


def _guard_worker(rank: int, world_size: int) -> str:
    """The guard itself refuses a scalar made without a device, and takes it on the device."""
    def run() -> str:
        dist.all_reduce(torch.tensor([1.0], device=torch.device("cpu")))
        dist.all_reduce(torch.tensor([1.0]).double().to(torch.device("cpu")))
        try:
            dist.all_reduce(torch.cat([torch.tensor([1.0]), torch.zeros(1)]).double())
        except RuntimeError as err:
            return str(err)
        return "taken"

    return _as_nccl_would(run)


def _probe_worker(rank: int, world_size: int) -> bool:
    from cephalo.trainer.profile_collectives import measure_link

    fit = _as_nccl_would(lambda: measure_link(torch.device("cpu"), repeats=1))
    return fit is not None


def _profiler_worker(rank: int, world_size: int) -> tuple[bool, float | None]:
    from cephalo.trainer.profile_collectives import measure_in_group

    fit = _as_nccl_would(lambda: measure_in_group(preset("llama-tiny"), torch.device("cpu"),
                                                  repeats=1))
    return fit is not None, None if fit is None else fit.probe_step_seconds


@pytest.mark.slow
def test_the_guard_refuses_what_nccl_refuses() -> None:
    assert spawn_ranks(_guard_worker, 2, timeout_seconds=60) == [NCCL_REFUSAL] * 2


@pytest.mark.slow
def test_the_network_probe_hands_nccl_only_device_tensors() -> None:
    assert spawn_ranks(_probe_worker, 2, timeout_seconds=120) == [True, False]


@pytest.mark.slow
def test_the_collective_profiler_hands_nccl_only_device_tensors() -> None:
    """measure_in_group, the engine probe included (llama-tiny fits the CPU)."""
    (rank0, probe), (rank1, _) = spawn_ranks(_profiler_worker, 2, timeout_seconds=240)
    assert rank0 and not rank1
    assert probe is not None and probe > 0.0  # the engine probe ran


def _hybrid_engine_worker(rank: int, world_size: int, reduce_precision: str) -> float:
    """A hybrid-sharding step, evaluation and full parameters: the gathers and
    reduce-scatters in each replica group, the cross-group all-reduces (in bf16 too) and
    the world's end-of-step all-reduce all take only device tensors."""
    from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine, Layout

    config = preset("llama-tiny")
    layout = Layout(batch_sizes=[2, 1, 1, 0], micro_batch_sizes=[1, 1, 1, 0],
                    shard_ratios=[0.7, 0.3, 0.7, 0.3], replica_groups=[[0, 1], [2, 3]])
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    start, end = layout.sample_range(rank)

    def run() -> float:
        engine = Engine(config, TrainingSpec(steps=1), layout, device=torch.device("cpu"),
                        reduce_precision=reduce_precision)
        loss = engine.step(data.micro_batches(0, start, end, max(1, end - start))).loss
        engine.evaluate(data.micro_batches(1, start, end, max(1, end - start)))
        engine.full_parameters()
        return loss

    return _as_nccl_would(run)


@pytest.mark.slow
@pytest.mark.parametrize("reduce_precision", ["fp32", "bf16"])
def test_hybrid_sharding_hands_nccl_only_device_tensors(reduce_precision: str) -> None:
    losses = spawn_ranks(_hybrid_engine_worker, 4, reduce_precision, timeout_seconds=120)
    assert len(set(losses)) == 1 and losses[0] > 0.0
