"""`--collectives`: measure AllGather and ReduceScatter of a unit-sized flat buffer with the
engine's own collectives, even and uneven shards, and fit each to the ring model
seconds = (n-1)/n · bytes / bandwidth + (n-1) · latency used by the planner; and the small
all-reduce every step ends with.

Each is timed as a run of back-to-back operations, as the engine issues them one unit after
another, rather than as one operation between barriers: leaving a barrier, ranks are skewed
by about one latency, which a single timed operation would count as its own.

Runs under torchrun (the environment gives rank and world size); returns the fit on rank 0
and None elsewhere."""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cephalo.api import trainer_env
from cephalo.api.models import ModelConfig
from cephalo.api.profile import CollectiveProfile
from cephalo.api.sharding import shard_bounds
from cephalo.trainer.collectives import UnevenCollectives
from cephalo.trainer.env import rank_device
from cephalo.trainer.nccl_env import init_group

FP32_BYTES = 4
BANDWIDTH_PROBE_ELEMENTS = 4 * 1024**2  # 16 MiB of fp32
# A timed run of back-to-back operations lasts about this long at most: on a slow link
# (tens of Mbit/s) an operation of one unit takes a tenth of a second or more, and sixteen
# of them per run, per repeat, per kind made a profile of minutes (measured: 74 s at
# 40 Mbit/s); one such operation already dwarfs the ranks' skew leaving a barrier.
RUN_SECONDS = 0.1


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a timed run on a GPU ends when its kernels and
    transfers have, not when the host has queued them (under NCCL `wait()` returns at
    once)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agreed(values: list[float], op: dist.ReduceOp.RedOpType, device: torch.device,
            group: dist.ProcessGroup | None) -> list[float]:
    """`values` reduced element-wise over the group's ranks with `op`, the same on every
    rank. The scalars travel on the group's device: NCCL has no CPU backend ("No backend
    type associated with device type cpu")."""
    value = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=op, group=group)
    return [float(v) for v in value.tolist()]


def _ops_within(seconds_one: float, ops: int, device: torch.device,
                group: dist.ProcessGroup | None) -> int:
    """How many of `ops` back-to-back operations of `seconds_one` each fit RUN_SECONDS, but
    at least 2 (or `ops` where fewer): one operation alone after the barrier would pay the
    transport's restart after idle (TCP's slow start) as bandwidth. Every rank must issue as
    many, so the slowest rank's figure decides."""
    [slowest] = _agreed([seconds_one], dist.ReduceOp.MAX, device, group)
    fit = int(RUN_SECONDS / max(slowest, 1e-9))
    return min(ops, max(2, fit))


def _per_op_seconds(coll: UnevenCollectives, kind: str, numel: int, ratios: list[float],
                    device: torch.device, repeats: int, ops: int) -> float:
    """Seconds of one `kind` collective of `numel` fp32 elements ("all_gather",
    "reduce_scatter" or "all_reduce"), issued `ops` times back to back as the engine issues
    a unit's collectives; the median over `repeats` runs of the slowest rank's mean."""
    bounds = shard_bounds(numel, ratios)
    start, end = bounds[coll.rank]
    shard = torch.ones(end - start, device=device)
    full = torch.ones(numel, device=device)

    def issue() -> None:
        if kind == "all_gather":
            coll.all_gather(shard, bounds, unit=0).wait()
        elif kind == "reduce_scatter":
            coll.reduce_scatter(full, bounds, unit=0, consume=False).wait()
        else:
            coll.all_reduce_sum(full)

    def one_seconds() -> float:
        _synchronize(device)
        began = time.perf_counter()
        issue()
        _synchronize(device)
        return time.perf_counter() - began

    issue()  # warms up connections and buffers
    if ops > 2:  # _ops_within never goes below 2: one timed operation more only to size
        ops = _ops_within(one_seconds(), ops, device, coll.group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=coll.group)
        began = time.perf_counter()
        for _ in range(ops):
            issue()
        _synchronize(device)
        times.append((time.perf_counter() - began) / ops)
    # Every rank must agree on the time: take the slowest rank's median.
    return _agreed([statistics.median(times)], dist.ReduceOp.MAX, device, coll.group)[0]


def _ring_fit(t_small: float, small: int, t_big: float, big: int, n: int
              ) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the ring model through two measured sizes."""
    per_byte = (t_big - t_small) / ((big - small) * FP32_BYTES)
    if per_byte <= 0:  # noise swamped the difference: all of the big transfer is bandwidth
        per_byte = t_big / (big * FP32_BYTES)
    latency = max(0.0, t_small - small * FP32_BYTES * per_byte) / (n - 1)
    return (n - 1) / n / per_byte, latency


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
        _synchronize(device)

    def timed(fn, ops: int = 8) -> float:
        # Runs of back-to-back operations, as in `_per_op_seconds`; a first run of one
        # operation, left out, warms up and sizes them.
        times: list[float] = []
        count = 1
        for run in range(repeats + 1):
            if run == 1:
                count = _ops_within(times[0], ops, device, coll.group)
            _synchronize(device)  # nothing queued before the run counts in it
            dist.barrier(group=coll.group)
            began = time.perf_counter()
            for _ in range(count):
                fn()
            # The all-gathers' transfers, not their launches (NCCL's wait() returns at once).
            _synchronize(device)
            times.append((time.perf_counter() - began) / count)
        return statistics.median(times[1:])

    t_comm = timed(lambda: coll.all_gather(shard, bounds, unit=0).wait())
    per_matmul = timed(lambda: compute(20), ops=1) / 20
    k = max(1, int(t_comm / max(per_matmul, 1e-9)))
    t_compute = timed(lambda: compute(k))

    def both() -> None:
        pending = coll.all_gather(shard, bounds, unit=0)
        compute(k)
        pending.wait()

    t_both = timed(both)
    hidden = (t_compute + t_comm - t_both) / max(min(t_compute, t_comm), 1e-12)
    # The least-overlapping rank decides.
    return _agreed([min(1.0, max(0.0, hidden))], dist.ReduceOp.MIN, device, coll.group)[0]


def _probe_fits(config: ModelConfig, device: torch.device, world_size: int) -> bool:
    """Whether an even shard of the training state is a small part of this device."""
    from cephalo.api.memory import STATE_BYTES_PER_PARAMETER
    from cephalo.trainer.device_info import device_facts
    from cephalo.trainer.profile import PROBE_MEMORY_FRACTION

    shard = STATE_BYTES_PER_PARAMETER * config.total_parameters() / world_size
    return shard <= PROBE_MEMORY_FRACTION * device_facts(device).memory_bytes


def _engine_probe(config: ModelConfig, device: torch.device, group: dist.ProcessGroup | None,
                  precision: str, steps: int, warmup: int = 2) -> float:
    """Seconds of one real training step (the engine's step and the trainer's per-step
    logging) with one sample per rank and even shards: the slowest rank's
    median. The paper's profiler runs such iterations on the target cluster; the planner
    compares this step with its own prediction of it to learn what the model of the
    collectives misses (ranks arriving at different times, the transport's share of the
    CPU, ...)."""
    from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine, Layout
    from cephalo.trainer.step_log import StepLogger

    n = dist.get_world_size(group)
    layout = Layout(batch_sizes=[1] * n, micro_batch_sizes=[1] * n, shard_ratios=[1.0 / n] * n)
    engine = Engine(config, TrainingSpec(), layout, group=group, device=device,
                    precision=precision)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    logger = StepLogger(rank=engine.rank, global_batch_size=n, local_batch_size=1,
                        tokens_per_sample=config.tokens_per_sample, flops_per_sample=0.0,
                        total_steps=0)
    start, end = layout.sample_range(engine.rank)
    times = []
    for step in range(warmup + steps):
        began = time.perf_counter()
        result = engine.step(data.micro_batches(step, start, end, 1))
        logger.log(result)
        if step >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(_agreed(times, dist.ReduceOp.MAX, device, group))


def measure_collectives(config: ModelConfig, repeats: int = 5,
                        precision: str = "fp32") -> CollectiveProfile | None:
    """Join torchrun's ranks, measure, leave; the fit on rank 0, None elsewhere."""
    env = trainer_env.read_env()
    if env.rank is None or env.world_size is None:
        raise ValueError(f"--collectives runs under torchrun ({trainer_env.RANK} and "
                         f"{trainer_env.WORLD_SIZE} unset)")
    device = rank_device(env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=120))
    try:
        return measure_in_group(config, device, repeats, precision=precision)
    finally:
        dist.destroy_process_group()


LINK_SMALL_ELEMENTS = 64 * 1024  # 256 KiB of fp32: latency shows
OVERLAP_OP_SECONDS = 0.01  # the link probe's overlap measurement: one all-gather this long


def measure_link(device: torch.device, repeats: int = 5,
                 group: dist.ProcessGroup | None = None, max_op_seconds: float = 0.25,
                 link_bytes_per_second: float | None = None) -> CollectiveProfile | None:
    """The network probe's measurement (trainer/netprobe.py): the engine's all-gather and
    reduce-scatter at 256 KiB and at up to 16 MiB, fitted to the ring model, the small
    all-reduce, and how much of the all-gather hides under compute — of the link alone,
    whatever the job's model. Bounded: the large size shrinks
    until one operation takes at most `max_op_seconds` (a slow link is measured with fewer
    bytes, never for minutes). `link_bytes_per_second`: an emulated link (tests; as the
    engine's, collectives.py). The fit on the group's rank 0, None elsewhere."""
    coll = UnevenCollectives(group)
    coll.link_bytes_per_second = link_bytes_per_second
    n = coll.world_size
    if n < 2:
        raise ValueError("a link is measured between at least 2 ranks")
    even = [1.0 / n] * n
    small = LINK_SMALL_ELEMENTS
    big = BANDWIDTH_PROBE_ELEMENTS
    # One timed run of the large size (its first operation warms the connection): shrink it
    # in proportion when it is too slow for the budget, by the same factor on every rank.
    seconds = _per_op_seconds(coll, "all_gather", big, even, device, repeats=1, ops=1)
    if seconds > max_op_seconds:
        big = max(4 * small, int(big * max_op_seconds / seconds))
    fits, t_big = {}, {}
    for kind in ("all_gather", "reduce_scatter"):
        t_small = _per_op_seconds(coll, kind, small, even, device, repeats, ops=8)
        t_big[kind] = _per_op_seconds(coll, kind, big, even, device, repeats, ops=2)
        fits[kind] = _ring_fit(t_small, small, t_big[kind], big, n)
    all_reduce = _per_op_seconds(coll, "all_reduce", 2, even, device, repeats, 16)
    # How well the link's all-gather hides under compute on these devices (the planner's
    # overlap_fraction; 1.0 where unmeasured), at a size whose all-gather takes about
    # OVERLAP_OP_SECONDS (between the small and the large size): long enough that launch
    # overheads do not swamp it on a fast GPU link, seconds in all on a slow one. A
    # difference of three noisy times: the median of three estimates of 3 runs each.
    numel = int(min(big, max(small, big * OVERLAP_OP_SECONDS / t_big["all_gather"])))
    overlap = statistics.median(_overlap_fraction(coll, numel, device, min(repeats, 3))
                                for _ in range(3))
    if coll.rank != 0:
        return None
    return _fitted(fits, all_reduce, n, overlap_fraction=overlap)


def _fitted(fits: dict[str, tuple[float, float]], all_reduce: float, n: int,
            **extra: float | None) -> CollectiveProfile:
    """The profile of the two ring fits (bandwidth, latency per kind) and the all-reduce."""
    return CollectiveProfile(
        bandwidth_bytes_per_second=fits["all_gather"][0], latency_seconds=fits["all_gather"][1],
        reduce_scatter_bandwidth_bytes_per_second=fits["reduce_scatter"][0],
        reduce_scatter_latency_seconds=fits["reduce_scatter"][1], all_reduce_seconds=all_reduce,
        world_size=n, **extra)


def measure_in_group(config: ModelConfig, device: torch.device, repeats: int = 5,
                     group: dist.ProcessGroup | None = None,
                     precision: str = "fp32") -> CollectiveProfile | None:
    """Measure over an initialised process group (every rank calls it); the fit on the
    group's rank 0, None elsewhere."""
    coll = UnevenCollectives(group)
    n = coll.world_size
    if n < 2:
        raise ValueError("--collectives needs at least 2 ranks (torchrun --nproc-per-node 2)")
    # The unit's own size, and one large enough that bandwidth dominates latency (a tiny
    # unit alone cannot separate the two).
    small = config.block_parameters()
    big = max(8 * small, BANDWIDTH_PROBE_ELEMENTS)
    even = [1.0 / n] * n
    skew = [2.0 * (i + 1) / (n * (n + 1)) for i in range(n)]  # 1:2:…:n

    def seconds(kind: str, numel: int, ratios: list[float]) -> float:
        # Enough back-to-back operations that one run lasts a few milliseconds at least.
        ops = 16 if numel == small else 2
        return _per_op_seconds(coll, kind, numel, ratios, device, repeats, ops)

    fits, uneven = {}, []
    for kind in ("all_gather", "reduce_scatter"):
        t_big = seconds(kind, big, even)
        fits[kind] = _ring_fit(seconds(kind, small, even), small, t_big, big, n)
        uneven.append(seconds(kind, big, skew) / t_big - 1.0)
    all_reduce = _per_op_seconds(coll, "all_reduce", 2, even, device, repeats, 16)
    # A difference of three noisy times: the median of three estimates.
    overlap = statistics.median(_overlap_fraction(coll, small, device, repeats)
                                for _ in range(3))
    probe = None
    if _probe_fits(config, device, n):
        probe = _engine_probe(config, device, group, precision, steps=max(12, 2 * repeats))
    if coll.rank != 0:
        return None
    return _fitted(fits, all_reduce, n, uneven_overhead=max(0.0, statistics.mean(uneven)),
                   overlap_fraction=overlap, probe_step_seconds=probe)
