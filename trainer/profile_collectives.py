"""`--collectives`: measure AllGather and ReduceScatter of a unit-sized flat buffer with the
engine's own collectives, even and uneven shards, and fit the ring model
seconds = (n-1)/n · bytes / bandwidth + (n-1) · latency used by the planner.

Runs under torchrun (the environment gives rank and world size); returns the fit on rank 0
and None elsewhere."""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cephalo.api.models import ModelConfig
from cephalo.api.profile import CollectiveProfile
from cephalo.api.sharding import shard_bounds
from cephalo.trainer.collectives import UnevenCollectives

FP32_BYTES = 4
BANDWIDTH_PROBE_ELEMENTS = 4 * 1024**2  # 16 MiB of fp32


def _time_pair(coll: UnevenCollectives, numel: int, ratios: list[float], device: torch.device,
               repeats: int) -> float:
    """Median seconds of one AllGather + one ReduceScatter of `numel` fp32 elements."""
    bounds = shard_bounds(numel, ratios)
    start, end = bounds[coll.rank]
    shard = torch.ones(end - start, device=device)
    grad = torch.ones(numel, device=device)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        began = time.perf_counter()
        coll.all_gather(shard, bounds, unit=0).wait()
        coll.reduce_scatter(grad, bounds, unit=0).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first round warms up connections
            times.append(time.perf_counter() - began)
    # Every rank must agree on the time: take the slowest rank's median.
    value = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item()) / 2  # per collective


def _overlap_fraction(coll: UnevenCollectives, numel: int, device: torch.device,
                      repeats: int) -> float:
    """How much of a collective hides under compute issued while it is in flight:
    (t_compute + t_collective - t_both) / min(t_compute, t_collective), in [0, 1]."""
    n = coll.world_size
    bounds = shard_bounds(numel, [1.0 / n] * n)
    start, end = bounds[coll.rank]
    shard = torch.ones(end - start, device=device)
    matrix = torch.randn(256, 256, device=device)

    def compute(k: int) -> None:
        x = matrix
        for _ in range(k):
            x = torch.tanh(x @ matrix)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return statistics.median(times[1:])

    t_comm = timed(lambda: coll.all_gather(shard, bounds, unit=0).wait())
    per_matmul = timed(lambda: compute(20)) / 20
    k = max(1, int(t_comm / max(per_matmul, 1e-9)))
    t_compute = timed(lambda: compute(k))

    def both() -> None:
        pending = coll.all_gather(shard, bounds, unit=0)
        compute(k)
        pending.wait()

    t_both = timed(both)
    hidden = (t_compute + t_comm - t_both) / max(min(t_compute, t_comm), 1e-12)
    value = torch.tensor([min(1.0, max(0.0, hidden))], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)  # the least-overlapping rank decides
    return float(value.item())


def measure_collectives(config: ModelConfig, repeats: int = 5) -> CollectiveProfile | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("--collectives runs under torchrun (RANK and WORLD_SIZE unset)")
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda \
        else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=120))
    try:
        coll = UnevenCollectives()
        n = coll.world_size
        if n < 2:
            raise ValueError("--collectives needs at least 2 ranks (torchrun --nproc-per-node 2)")
        # The unit's own size, and one large enough that bandwidth dominates latency (a tiny
        # unit alone cannot separate the two).
        small = config.block_parameters()
        big = max(8 * small, BANDWIDTH_PROBE_ELEMENTS)
        even = [1.0 / n] * n
        skew = [2.0 * (i + 1) / (n * (n + 1)) for i in range(n)]  # 1:2:…:n
        t_small = _time_pair(coll, small, even, device, repeats)
        t_big = _time_pair(coll, big, even, device, repeats)
        t_uneven = _time_pair(coll, big, skew, device, repeats)
        overlap = _overlap_fraction(coll, small, device, repeats)
    finally:
        dist.destroy_process_group()
    if coll.rank != 0:
        return None
    per_byte = (t_big - t_small) / ((big - small) * FP32_BYTES)
    if per_byte <= 0:  # noise swamped the difference: all of the big transfer is bandwidth
        per_byte = t_big / (big * FP32_BYTES)
    latency = max(0.0, t_small - small * FP32_BYTES * per_byte) / (n - 1)
    return CollectiveProfile(bandwidth_bytes_per_second=(n - 1) / n / per_byte,
                             latency_seconds=latency, world_size=n,
                             uneven_overhead=max(0.0, t_uneven / t_big - 1.0),
                             overlap_fraction=overlap)
