"""CEPHALO_LINK_BYTES_PER_SECOND (trainer/collectives.py): every collective crosses one
emulated serial link, so a slow network can be emulated on one machine (the re-planning
tests' 10 Mbit/s, docs/replanning.md). On gloo, two ranks: a gather, a reduce-scatter and the
step's all-reduce each take at least their bytes' time on the link, one after the other."""

from __future__ import annotations

import time

import pytest
import torch

from cephalo.trainer.collectives import UnevenCollectives
from cephalo.trainer.spawn import spawn_ranks

LINK = 1e6  # bytes/s
NUMEL = 50_000  # fp32: 200 kB; a ring moves half of it on two ranks: 0.1 s


def _worker(rank: int, world_size: int) -> dict[str, float]:
    comm = UnevenCollectives()
    bounds = [(0, NUMEL // 2), (NUMEL // 2, NUMEL)]
    comm.all_gather(torch.ones(NUMEL // 2), bounds, 0).wait()  # gloo's connections up
    comm.link_bytes_per_second = LINK
    started = time.perf_counter()
    gathered = comm.all_gather(torch.full((NUMEL // 2,), float(rank)), bounds, 0)
    scattered = comm.reduce_scatter(torch.ones(NUMEL), bounds, 1)  # queued behind the gather
    issued = time.perf_counter() - started
    full = gathered.wait()
    after_gather = time.perf_counter() - started
    shard = scattered.wait()
    after_both = time.perf_counter() - started
    total = comm.all_reduce_sum(torch.zeros(10, dtype=torch.float64))
    after_all = time.perf_counter() - started
    return {"issued": issued, "gather": after_gather, "both": after_both, "all": after_all,
            "sum": float(full.sum()), "shard": float(shard.sum()), "reduced": float(total.sum()),
            "waited": sum(comm.stats.wait_seconds.values())}


@pytest.mark.slow  # two gloo processes
def test_collectives_cross_the_emulated_link_one_after_the_other() -> None:
    one = (NUMEL // 2) * 4 / LINK  # (n-1)/n of a 200 kB buffer at 1 MB/s: 0.1 s
    for r in spawn_ranks(_worker, 2, timeout_seconds=90):
        assert r["sum"] == NUMEL // 2 and r["shard"] == 2 * (NUMEL // 2)  # still right
        assert r["reduced"] == 0.0
        assert r["gather"] >= one and r["both"] >= 2 * one  # serial: the second waited
        assert r["all"] >= 2 * one + 40 / LINK  # the 80-byte all-reduce's half too
        # From issue to done it was all waiting, as on a slow network (what the trainer's
        # compute / wait split then reports); time spent issuing overlapped the link.
        assert r["waited"] >= r["both"] - r["issued"] - 0.01
