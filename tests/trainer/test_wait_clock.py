"""Collective wait time as NCCL makes it (issue 43, item 2): under NCCL `Work.wait()` only makes
the compute stream wait and returns at once, so the host's clock around it reads about zero
however slow the network. Waits are timed on the stream with events instead, counted once the
stream has passed them. Here a fake `Work` returns from wait() at once and moves a fake
stream timeline to the transfer's end, and fake events read that timeline."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.collectives import (
    CROSS_ALL_REDUCE,
    CollectiveStats,
    Pending,
    UnevenCollectives,
)
from cephalo.trainer.replicas import GradientSync
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.wait_clock import StreamWaitClock


@dataclass
class Stream:
    """The compute stream: the time (ms) at which the work enqueued on it so far ends."""

    now_ms: float = 0.0

    def enqueue(self, ms: float) -> None:
        self.now_ms += ms


@dataclass
class FakeEvent:
    stream: Stream
    at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.stream.now_ms

    def synchronize(self) -> None:
        assert self.at_ms is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.at_ms is not None and end_event.at_ms is not None
        return end_event.at_ms - self.at_ms


@dataclass
class NcclWork:
    """NCCL's Work: wait() makes the compute stream wait for the transfer, which ends at
    `ends_ms` on the stream's clock, and returns to the host at once."""

    stream: Stream
    ends_ms: float
    waited: list[bool] = field(default_factory=list)

    def wait(self) -> bool:
        self.stream.now_ms = max(self.stream.now_ms, self.ends_ms)
        self.waited.append(True)
        return True


def test_a_wait_that_returns_at_once_counts_the_stream_s_stall() -> None:
    stream = Stream()
    stats = CollectiveStats(clock=StreamWaitClock(lambda: FakeEvent(stream)))
    out = torch.zeros(4)
    stream.enqueue(100.0)  # compute up to 100 ms; the gather's transfer ends at 350 ms
    gather = Pending([NcclWork(stream, 350.0)], out, "all_gather", stats)
    gather.wait()
    stream.enqueue(200.0)  # compute to 550 ms; this transfer ended at 500: no stall
    Pending([NcclWork(stream, 500.0)], out, "all_gather", stats).wait()
    # A reduce-scatter ending at 600 ms, then its copy-out of 5 ms on the stream.
    scatter = Pending([NcclWork(stream, 600.0)], out, "reduce_scatter", stats,
                      finish=lambda: stream.enqueue(5.0))
    scatter.wait()
    assert dict(stats.wait_seconds) == {}  # not counted before the stream has passed them
    stats.settle()
    assert stats.wait_seconds == pytest.approx({"all_gather": 0.25, "reduce_scatter": 0.055})
    stats.settle()  # counted once
    assert stats.wait_seconds == pytest.approx({"all_gather": 0.25, "reduce_scatter": 0.055})


def test_reset_forgets_waits_not_counted_yet() -> None:
    stream = Stream()
    stats = CollectiveStats(clock=StreamWaitClock(lambda: FakeEvent(stream)))
    Pending([NcclWork(stream, 10.0)], torch.zeros(1), "all_gather", stats).wait()
    stats.reset()
    stats.settle()
    assert dict(stats.wait_seconds) == {}


def test_an_nccl_group_times_waits_on_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert isinstance(UnevenCollectives(None).stats.clock, StreamWaitClock)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert not isinstance(UnevenCollectives(None).stats.clock, StreamWaitClock)


class DeferredClock:
    """A clock that, like the stream's, counts a wait only at settle(): one second each,
    so what the engine reports is an exact count of the waits it settled in time."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.stopped: list[str] = []

    def start(self) -> None:
        return None

    def stop(self, kind: str, token: None, into: defaultdict[str, float]) -> None:
        self.pending.append(kind)
        self.stopped.append(kind)

    def settle(self, into: defaultdict[str, float]) -> None:
        for kind in self.pending:
            into[kind] += 1.0
        self.pending.clear()

    def discard(self) -> None:
        self.pending.clear()


def _engine_worker(rank: int, world_size: int, hybrid: bool) -> dict:
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine, Layout

    config = preset("llama-tiny")
    layout = Layout(batch_sizes=[2, 1], micro_batch_sizes=[1, 1], shard_ratios=[0.7, 0.3])
    if hybrid:  # two replica groups of one rank: the waits are the cross-group all-reduces'
        layout = Layout(batch_sizes=[2, 1], micro_batch_sizes=[1, 1], shard_ratios=[1, 1],
                        replica_groups=[[0], [1]])
    engine = Engine(config, TrainingSpec(steps=2), layout)
    clock = DeferredClock()
    engine.comm.stats.clock = clock
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    start, end = layout.sample_range(rank)
    result = engine.step(data.micro_batches(0, start, end, 1))
    step_stops = list(clock.stopped)
    engine.evaluate(data.micro_batches(1, start, end, 1))
    return {"rank_wait": result.rank_wait_seconds, "wait": result.collective_wait_seconds,
            "step_stops": step_stops, "all_stops": list(clock.stopped),
            "settled": dict(engine.comm.stats.wait_seconds)}


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True])
def test_the_engine_counts_stream_timed_waits_before_it_reports_them(hybrid: bool) -> None:
    """The waits before the end-of-step all-reduce ride on it (every rank's wait seconds);
    the all-reduce's own and the evaluation's are counted by the time they return. Under
    hybrid sharding the cross-group all-reduces' waits are among them."""
    results = spawn_ranks(_engine_worker, 2, hybrid, timeout_seconds=120)
    for rank, r in enumerate(results):
        before_reduce = [k for k in r["step_stops"] if k != "all_reduce"]
        assert (CROSS_ALL_REDUCE in before_reduce) == hybrid
        assert r["step_stops"][-1] == "all_reduce" and len(before_reduce) > 0
        assert r["rank_wait"][rank] == len(before_reduce)
        assert r["wait"] == len(r["step_stops"])
        assert sum(r["settled"].values()) == len(r["all_stops"]) > len(r["step_stops"])
    assert results[0]["rank_wait"] == results[1]["rank_wait"]  # everyone's, by rank


@dataclass
class StreamCollectives:
    """A cross-group `UnevenCollectives` as NCCL makes it: each all-reduce a `NcclWork` that
    ends `transfer_ms` after it is issued, on the stream's timeline; records the issue order."""

    stream: Stream
    stats: CollectiveStats
    transfer_ms: float
    issued: list[int] = field(default_factory=list)

    def all_reduce(self, shard: torch.Tensor, unit: int,
                   wire_dtype: torch.dtype | None = None) -> Pending:
        self.issued.append(unit)
        work = NcclWork(self.stream, self.stream.now_ms + self.transfer_ms)
        return Pending([work], shard, CROSS_ALL_REDUCE, self.stats)


def test_hybrid_gradient_sums_start_in_order_and_their_stalls_are_timed_on_the_stream() -> None:
    """GradientSync (hybrid sharding) under waits that return at once: unit u's cross-group
    all-reduce starts when the next reduce-scatter is followed (not before: its shard is not
    summed in the group yet), in the reduce-scatters' order; only the stall left at the end
    of backward counts as the all-reduces' wait, once the stream has passed it."""
    stream = Stream()
    stats = CollectiveStats(clock=StreamWaitClock(lambda: FakeEvent(stream)))
    cross = StreamCollectives(stream, stats, transfer_ms=50.0)
    sync = GradientSync(cross, None)  # type: ignore[arg-type]  # the fake's one method
    sync.begin()
    shards = {u: torch.full((2,), float(u)) for u in range(3)}
    for u in (2, 1, 0):  # backward: the head first; each reduce-scatter ends 10 ms on
        scatter = Pending([NcclWork(stream, stream.now_ms + 10.0)], shards[u],
                          "reduce_scatter", stats)
        assert sync.follow(u, scatter) is scatter
        assert cross.issued == [2, 1, 0][:2 - u]  # the one before it, no more
        stream.enqueue(100.0)  # the next unit's backward: covers the transfers
    got = sync.finish(3)
    assert cross.issued == [2, 1, 0]
    assert [g[0].item() for g in got] == [0.0, 1.0, 2.0]  # by unit
    assert dict(stats.wait_seconds) == {}  # not counted before the stream passed them
    stats.settle()
    # Units 2 and 1 were summed under 100 ms of backward each: no stall. Unit 0's
    # reduce-scatter had its backward; its all-reduce starts at finish(): a 50 ms stall.
    assert stats.wait_seconds[CROSS_ALL_REDUCE] == pytest.approx(0.05)
    assert stats.wait_seconds["reduce_scatter"] == pytest.approx(0.0)
