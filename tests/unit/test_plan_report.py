"""The printed plan (`cephalo plan`, and `cephalo run` before training): the words and the
figures a newcomer reads (issue 26 items 4, 7 and 13)."""

from __future__ import annotations

from cephalo.api.plan import Plan
from cephalo.planner.report import format_plan


def _plan(world: int = 2, used_bytes: int = 40 * 2**20, cap_bytes: int = 3 * 2**30,
          **extra: object) -> Plan:
    return Plan.model_validate({
        "global_batch_size": 4 * world, "world_size": world, "predicted_step_seconds": 0.1,
        "predicted_samples_per_second": 40.0 * world,
        "ranks": [{"rank": i, "gpu": "cpu", "batch_size": 4, "micro_batch_size": 4,
                   "num_micro_batches": 1, "shard_ratio": 1 / world,
                   "predicted_memory_bytes": used_bytes, "memory_capacity_bytes": cap_bytes}
                  for i in range(world)], **extra})


def test_memory_shows_each_figure_in_a_unit_that_shows_it() -> None:
    """Issue 26 item 4: CPU ranks showed `0.0 / 2.9 GiB` (40 MiB used)."""
    row = format_plan(_plan(), "gpt-tiny").splitlines()[4]
    assert "40.0 MiB /   3.0 GiB" in row, row
    big = format_plan(_plan(used_bytes=5 * 2**30, cap_bytes=24 * 2**30), "x").splitlines()[4]
    assert "5.0 GiB /  24.0 GiB" in big, big
