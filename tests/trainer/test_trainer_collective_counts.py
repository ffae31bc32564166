"""Layered gradient accumulation issues one AllGather per unit per pass and one
ReduceScatter per unit per step, whatever the number of microbatches."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.spawn import spawn_ranks


def _worker(rank: int, world_size: int, layout: Layout, recompute: bool) -> dict:
    config = preset("llama-tiny")
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, TrainingSpec(steps=2), layout, recompute=recompute)
    start, end = layout.sample_range(rank)
    per_step = []
    for step in range(2):
        engine.comm.stats.reset()
        engine.step(data.micro_batches(step, start, end, layout.micro_batch_sizes[rank]))
        stats = engine.comm.stats
        per_step.append({"calls": dict(stats.calls), "log": list(stats.log),
                         "native": dict(stats.native_calls)})
    return {"num_units": len(engine.units), "steps": per_step}


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [True, False])
def test_one_gather_per_unit_per_pass(recompute: bool) -> None:
    # rank 0: 8 microbatches of 1; rank 1: 1 microbatch of 4 and no shard; rank 2: state only.
    layout = Layout(batch_sizes=[8, 4, 0], micro_batch_sizes=[1, 4, 0],
                    shard_ratios=[0.8, 0.0, 0.2])  # rank 1 computes but owns no state
    results = spawn_ranks(_worker, 3, layout, recompute, timeout_seconds=90)
    num_units = results[0]["num_units"]
    head = num_units - 1
    for rank, result in enumerate(results):
        for step in result["steps"]:
            log = step["log"]
            gathers = Counter(unit for kind, unit in log if kind == "all_gather")
            scatters = Counter(unit for kind, unit in log if kind == "reduce_scatter")
            # Forward gathers every unit once in order; the head runs forward+backward at
            # once; backward (with recompute) gathers the other units once more in reverse.
            forward = list(range(num_units))
            backward = list(range(head - 1, -1, -1)) if recompute else []
            assert [u for kind, u in log if kind == "all_gather"] == forward + backward, rank
            assert all(gathers[u] == (2 if recompute else 1) for u in range(head)), rank
            assert gathers[head] == 1
            assert scatters == Counter(range(num_units)), rank
            assert [u for kind, u in log if kind == "reduce_scatter"] == \
                list(range(head, -1, -1))
            assert step["calls"]["all_reduce"] == 1
            # Same counts on the rank with 8 microbatches, 1 microbatch and none.
            assert step["calls"] == results[0]["steps"][0]["calls"]


@pytest.mark.parametrize("recompute", [True, False])
def test_cost_model_charges_the_collectives_the_engine_issues(recompute: bool) -> None:
    # The counts asserted above, priced by the planner: with no compute and no bandwidth
    # cost, one AllGather costs 1 s, one ReduceScatter 1000 s and one small all-reduce 1e6 s,
    # so the predicted step spells out how many of each the model charges.
    from cephalo.api.profile import GpuProfile, ProfilePoint
    from cephalo.planner.cost.catalog import lookup_gpu
    from cephalo.planner.cost.comm_model import CommModel, UnitComm
    from cephalo.planner.cost.costmodel import GpuCostModel

    config = preset("llama-tiny")
    zero = ProfilePoint(micro_batch_size=1, block_forward_seconds=0.0,
                        block_backward_seconds=0.0, compute_memory_bytes=0)
    profile = GpuProfile(product="cpu", memory_capacity_bytes=2**30, model_key="x",
                         points=[zero])
    cost = GpuCostModel(lookup_gpu("cpu"), profile, 2**30, config.num_layers)
    if not recompute:
        cost = cost.without_recompute(config)
    comm = CommModel(bandwidth_bytes_per_second=1e30, latency_seconds=1.0,
                     reduce_scatter_latency_seconds=1000.0, all_reduce_seconds=1e6,
                     overlap_fraction=0.0)
    unit = UnitComm.build(config, comm, world_size=2, uneven=False)
    total = round(float(cost.step_seconds(np.array([3]), np.array([2]), unit)[0]))
    num_units = config.num_layers + 2
    gathers, scatters, all_reduces = total % 1000, total // 1000 % 1000, total // 10**6
    # Forward, then (with recompute) backward without the head.
    assert gathers == num_units + (num_units - 1 if recompute else 0)
    assert scatters == num_units
    assert all_reduces == 2  # the engine's [grad norm, loss] and the trainer's timings
