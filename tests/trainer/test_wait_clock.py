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
    CROSS_ALL_GATHER,
    CROSS_REDUCE_SCATTER,
    CollectiveStats,
    Pending,
    UnevenCollectives,
)
from cephalo.trainer.replicas import CrossGroupShards
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
    if hybrid:  # two replica groups of one rank: among the waits, the cross-group ones'
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
        assert (CROSS_REDUCE_SCATTER in before_reduce) == hybrid
        # The step's update is all-gathered across the groups after it; the evaluation
        # (the next forward) waits for it.
        assert CROSS_ALL_GATHER not in r["step_stops"]
        assert (CROSS_ALL_GATHER in r["all_stops"]) == hybrid
        assert r["step_stops"][-1] == "all_reduce" and len(before_reduce) > 0
        assert r["rank_wait"][rank] == len(before_reduce)
        assert r["wait"] == len(r["step_stops"])
        assert sum(r["settled"].values()) == len(r["all_stops"]) > len(r["step_stops"])
    assert results[0]["rank_wait"] == results[1]["rank_wait"]  # everyone's, by rank


@dataclass
class StreamCollectives:
    """A cross-group `UnevenCollectives` as NCCL makes it: each collective a `NcclWork` that
    ends `transfer_ms` after it is issued, on the stream's timeline; records the issue order."""

    stream: Stream
    stats: CollectiveStats
    transfer_ms: float
    issued: list[tuple[str, int]] = field(default_factory=list)
    works: dict[int, NcclWork] = field(default_factory=dict)  # the gathers', by unit

    def reduce_scatter(self, full_grad: torch.Tensor, bounds: list[tuple[int, int]],
                       unit: int, wire_dtype: torch.dtype | None = None) -> Pending:
        self.issued.append(("reduce_scatter", unit))
        work = NcclWork(self.stream, self.stream.now_ms + self.transfer_ms)
        start, end = bounds[0]  # this rank owns piece 0
        return Pending([work], full_grad[start:end], CROSS_REDUCE_SCATTER, self.stats)

    def all_gather(self, piece: torch.Tensor, bounds: list[tuple[int, int]], unit: int,
                   wire_dtype: torch.dtype | None = None) -> Pending:
        self.issued.append(("all_gather", unit))
        self.works[unit] = NcclWork(self.stream, self.stream.now_ms + self.transfer_ms)
        full = torch.cat([piece, torch.full((bounds[-1][1] - piece.numel(),), -1.0)])
        return Pending([self.works[unit]], full, CROSS_ALL_GATHER, self.stats)


def test_cross_group_collectives_start_in_order_and_hide_under_the_passes() -> None:
    """CrossGroupShards (hybrid sharding) under waits that return at once. Backward: unit
    u's cross-group reduce-scatter starts when the next reduce-scatter is followed (not
    before: its slice gradient is not summed in the group yet), in the reduce-scatters'
    order; only the stall left at the end of backward counts. After the update: every
    piece's all-gather starts at once, unit 0 first, and none is waited for until the next
    forward reads that unit's slice, so each hides under the forward of the units before
    it; only unit 0's stalls."""
    stream = Stream()
    stats = CollectiveStats(clock=StreamWaitClock(lambda: FakeEvent(stream)))
    cross = StreamCollectives(stream, stats, transfer_ms=50.0)
    slices = [torch.zeros(4) for _ in range(3)]
    sync = CrossGroupShards(cross, slices, 0, 2, None, None)  # type: ignore[arg-type]
    assert [sync.master_ranges(u) for u in range(3)] == [[(0, 2)]] * 3
    sync.begin()
    grads = {u: torch.full((4,), float(u)) for u in range(3)}
    for u in (2, 1, 0):  # backward: the head first; each reduce-scatter ends 10 ms on
        scatter = Pending([NcclWork(stream, stream.now_ms + 10.0)], grads[u],
                          "reduce_scatter", stats)
        assert sync.follow(u, scatter) is scatter
        assert cross.issued == [("reduce_scatter", v) for v in (2, 1, 0)][:2 - u]
        stream.enqueue(100.0)  # the next unit's backward: covers the transfers
    got = sync.finish(3)
    assert [g.tolist() for g in got] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]  # by unit
    assert dict(stats.wait_seconds) == {}  # not counted before the stream passed them
    stats.settle()
    # Units 2 and 1 were reduced under 100 ms of backward each: no stall. Unit 0's
    # reduce-scatter had its backward; its cross-group one starts at finish(): 50 ms.
    assert stats.wait_seconds[CROSS_REDUCE_SCATTER] == pytest.approx(0.05)
    assert stats.wait_seconds["reduce_scatter"] == pytest.approx(0.0)
    sync.publish([torch.full((2,), 7.0 + u) for u in range(3)])  # the optimizer's update
    assert cross.issued[3:] == [("all_gather", u) for u in range(3)]
    assert sync.outstanding == [0, 1, 2] and not any(w.waited for w in cross.works.values())
    for u in range(3):  # the next forward: unit u's slice just before its group gathers it
        assert sync.slice(u)[:2].tolist() == [7.0 + u] * 2
        assert [bool(cross.works[v].waited) for v in range(3)] == [v <= u for v in range(3)]
        stream.enqueue(30.0)  # unit u's forward
    stats.settle()
    # Unit 0 waited its whole transfer (50 ms); units 1's and 2's, issued with it, ended
    # while unit 0's forward ran: no stall.
    assert stats.wait_seconds[CROSS_ALL_GATHER] == pytest.approx(0.05)
    assert sync.slices[2][:2].tolist() == [9.0, 9.0]  # the gathered slice replaced the old
