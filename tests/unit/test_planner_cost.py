"""planner.objective: cost against brute force: on random small instances with random
prices and floors, the plan's price per sample is the least over every subset of the GPUs
(each subset at its own brute-force optimum over assignments and modes) among the subsets
that meet the throughput floor; no subset meets it -> InfeasibleError with the numbers."""

from __future__ import annotations

import os
import random

import pytest

from cephalo.api import ClusterSpec, GpuGroup
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.outputs.report import format_plan, plural

from .planner_instances import job_spec, random_instance
from .test_planner_oracle import brute_force, sub_clusters

# Instances of up to three and of four GPUs (seeds 20000.. and 30000..); more with
# CEPHALO_ORACLE_INSTANCES (the throughput oracle's variable).
COST_INSTANCES = int(os.environ.get("CEPHALO_ORACLE_INSTANCES", "150"))


def _priced(seed: int, max_gpus: int, max_batch: int):
    """A random instance with a price per product and, in two of three cases, a floor drawn
    around the fastest plan's throughput (so that it binds, or cannot be met, in some)."""
    spec, cluster, profiles = random_instance(seed, max_gpus=max_gpus, max_batch=max_batch)
    rng = random.Random(seed * 7919 + 1)
    prices = {g.product: round(rng.uniform(0.1, 4.0), 3) for g in cluster.groups}
    planner = {"objective": "cost", "gpu_prices_per_hour": prices}
    return spec, cluster, profiles, planner, rng


def _check(seed: int, max_gpus: int, max_batch: int) -> None:
    spec, cluster, profiles, planner, rng = _priced(seed, max_gpus, max_batch)
    found = []  # (price per sample, step seconds) of every subset that fits
    for sub in sub_clusters(cluster):
        step = brute_force(spec, sub, profiles)
        if step is not None:
            hourly = sum(g.count * planner["gpu_prices_per_hour"][g.product]
                         for g in sub.groups)
            found.append((hourly / 3600 * step / spec.global_batch_size, step))
    floor = None
    if found and rng.random() < 2 / 3:
        fastest = min(step for _, step in found)
        floor = spec.global_batch_size / fastest * rng.uniform(0.3, 1.1)
        planner["min_samples_per_second"] = floor
    job = spec.model_copy(update={"planner": spec.planner.model_copy(update=planner)})
    meeting = [(cost, step) for cost, step in found
               if floor is None or step <= spec.global_batch_size / floor * (1 + 1e-12)]
    if not meeting:
        with pytest.raises(InfeasibleError) as err:
            solve(job, cluster, profiles, choose_gpus=True)
        if found:
            assert "samples/s" in str(err.value), str(err.value)
        return
    plan = solve(job, cluster, profiles, choose_gpus=True)
    assert plan.cost is not None and plan.search["objective"] == "cost"
    expected = min(cost for cost, _ in meeting)
    assert plan.cost.price_per_million_samples == pytest.approx(expected * 1e6, rel=1e-9), seed
    assert plan.predicted_step_seconds is not None
    if floor is not None:
        assert plan.predicted_samples_per_second >= floor * (1 - 1e-9)
    assert plan.search["gpu_subsets_exhaustive"] is True


def _check_seeds(seeds: range, max_gpus: int, max_batch: int) -> None:
    failed = []
    for seed in seeds:
        try:
            _check(seed, max_gpus, max_batch)
        except AssertionError as err:
            failed.append(f"seed {seed}: {str(err).splitlines()[0]}")
    assert not failed, f"{len(failed)} of {len(seeds)} instances disagree: " + "; ".join(failed)


@pytest.mark.parametrize("first", range(0, COST_INSTANCES, 50))
def test_cost_plan_matches_brute_force(first: int) -> None:
    _check_seeds(range(20_000 + first, 20_000 + first + 50), max_gpus=3, max_batch=8)


@pytest.mark.parametrize("first", range(0, COST_INSTANCES, 50))
def test_cost_plan_matches_brute_force_four_gpus(first: int) -> None:
    _check_seeds(range(30_000 + first, 30_000 + first + 50), max_gpus=4, max_batch=7)


def _cost_job(batch: int, preset: str, **planner: object):
    return job_spec(batch, preset, objective="cost", **planner)


CLOUD = ClusterSpec(groups=[GpuGroup(product="A10G", count=4), GpuGroup(product="T4", count=4)],
                    network_bandwidth_bytes_per_second=100e9 / 8)
PRICES = {"NVIDIA-A10G": 1.006, "Tesla-T4": 0.526}


def test_cost_objective_says_what_it_costs_and_the_throughput_plan_does_too() -> None:
    """The cheaper plan per sample is never more expensive than the fastest one, both state
    their prices, and `cephalo plan`'s table prices every baseline."""
    cheap = solve(_cost_job(64, "gpt-small", gpuPricesPerHour=PRICES), CLOUD, choose_gpus=True)
    fast = solve(job_spec(64, "gpt-small", gpuPricesPerHour=PRICES), CLOUD, choose_gpus=True)
    assert cheap.cost is not None and fast.cost is not None
    assert fast.cost.objective == "throughput" and cheap.cost.objective == "cost"
    assert cheap.cost.price_per_million_samples <= fast.cost.price_per_million_samples * (
        1 + 1e-12)
    assert fast.predicted_step_seconds <= cheap.predicted_step_seconds * (1 + 1e-12)
    assert cheap.cost.price_per_million_tokens == pytest.approx(
        cheap.cost.price_per_million_samples / 64)  # gpt-small: 64 tokens per sample
    used = {r.gpu for r in cheap.ranks}
    hourly = sum(PRICES["NVIDIA-" + g if g == "A10G" else "Tesla-" + g]
                 for g in (r.gpu for r in cheap.ranks))
    assert cheap.cost.price_per_hour == pytest.approx(hourly) and used
    text = format_plan(cheap, "gpt-small")
    used_gpus = plural(cheap.world_size, "GPU")
    assert f"${cheap.cost.price_per_hour:.4g}/hour for the {used_gpus} used" in text
    assert "$/M samples" in text
    # Without prices a plan keeps its bytes: no cost field at all.
    plain = solve(job_spec(64, "gpt-small"), CLOUD, choose_gpus=True)
    assert plain.cost is None and '"cost"' not in plain.to_json()


def test_a_floor_nothing_meets_is_one_line_with_the_fastest_throughput() -> None:
    fast = solve(job_spec(64, "gpt-small"), CLOUD, choose_gpus=True)
    assert fast.predicted_samples_per_second is not None
    floor = fast.predicted_samples_per_second * 1.5
    with pytest.raises(InfeasibleError) as err:
        solve(_cost_job(64, "gpt-small", gpuPricesPerHour=PRICES, minSamplesPerSecond=floor),
              CLOUD, choose_gpus=True)
    message = str(err.value)
    assert "\n" not in message and f"{floor:.4g} samples/s" in message
    assert f"the fastest plan gives {fast.predicted_samples_per_second:.4g}" in message
    # A deadline is a floor too: the training steps (or those left) within it.
    steps_left = 100
    deadline = steps_left * 64 / floor
    with pytest.raises(InfeasibleError, match="deadlineSeconds"):
        solve(_cost_job(64, "gpt-small", gpuPricesPerHour=PRICES, deadlineSeconds=deadline),
              CLOUD, choose_gpus=True, remaining_steps=steps_left)


def test_a_gpu_type_without_a_price_is_named() -> None:
    with pytest.raises(InfeasibleError,
                       match=r"none for T4; add them to planner\.gpuPricesPerHour"):
        solve(_cost_job(64, "gpt-small", gpuPricesPerHour={"A10G": 1.0}), CLOUD)


def test_one_gpu_used_is_said_in_the_singular() -> None:
    """Issue 39 item 6: `cephalo plan` said "for the 1 GPUs used"."""
    one = ClusterSpec(groups=[GpuGroup(product="T4", count=1)])
    plan = solve(_cost_job(8, "gpt-tiny", gpuPricesPerHour=PRICES), one, choose_gpus=True)
    assert plan.cost is not None and plan.world_size == 1
    text = format_plan(plan, "gpt-tiny")
    assert f"${plan.cost.price_per_hour:.4g}/hour for the 1 GPU used," in text
    assert "1 GPUs" not in text
