"""The emulation a given plan runs under (`cephalo run --plan` on `--emulate`d GPUs)."""

from __future__ import annotations

import pytest

from cephalo.api.plan import Plan
from cephalo.local.emulate import given_plan_emulation
from cephalo.planner.cost.catalog import lookup_gpu


def _plan(capacities: list[int | None]) -> Plan:
    n = len(capacities)
    return Plan.model_validate({
        "global_batch_size": 2 * n, "world_size": n,
        "ranks": [{"rank": i, "batch_size": 2, "micro_batch_size": 2, "num_micro_batches": 1,
                   "shard_ratio": 1 / n, "memory_capacity_bytes": c}
                  for i, c in enumerate(capacities)]})


def test_dilation_is_the_catalog_peak_ratio_and_memory_the_plans() -> None:
    products = ["RTX-A6000", "P40", "P40"]
    emu = given_plan_emulation(_plan([40 << 20, 20 << 20, 18 << 20]), products, "fp32", "p")
    a6000, p40 = (lookup_gpu(p).peak_flops("fp32") for p in ("RTX-A6000", "P40"))
    assert emu.dilation == {"RTX-A6000": 1.0, "P40": pytest.approx(a6000 / p40)}
    # Two P40s planned against different capacities: the smaller caps both.
    assert emu.capacity_bytes == {"RTX-A6000": 40 << 20, "P40": 18 << 20}


def test_an_explicit_memory_scale_wins_and_covers_a_plan_without_capacities() -> None:
    emu = given_plan_emulation(_plan([None, None]), ["RTX-A6000", "P40"], "bf16", "p", 1e-3)
    assert emu.capacity_bytes == {p: int(lookup_gpu(p).memory_bytes * 1e-3)
                                  for p in ("RTX-A6000", "P40")}
    with pytest.raises(ValueError, match="rank 1 \\(emulated P40\\) records no memory_capacity"):
        given_plan_emulation(_plan([1 << 20, None]), ["RTX-A6000", "P40"], "fp32", "p")


def test_the_fastest_emulated_gpu_is_said_to_run_at_the_cpus_speed() -> None:
    """Issue 26 item 13: 'compute x1.00 slower than this CPU'."""
    emu = given_plan_emulation(_plan([40 << 20, 20 << 20]), ["RTX-A6000", "P40"], "fp32", "p")
    assert emu.describe("RTX-A6000").startswith(
        "emulated RTX-A6000: compute at this CPU's speed (the fastest emulated GPU), memory ")
    assert emu.describe("P40").startswith("emulated P40: compute 3.29x slower than this CPU")
