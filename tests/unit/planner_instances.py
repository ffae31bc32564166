"""Random small planning instances shared by the planner tests."""

from __future__ import annotations

import random

from cephalo.api import ClusterSpec, GpuGroup, GpuProfile, ProfilePoint, parse_job
from cephalo.api.job import CephaloJobSpec
from cephalo.api.memory import STATE_BYTES_PER_PARAMETER
from cephalo.api.profile import model_key

PRODUCTS = ["L4", "T4", "P40", "A10G"]
MIB = 1024**2


def job_spec(batch: int, preset: str = "gpt-tiny", allow_state_only: bool = True,
             **planner: object) -> CephaloJobSpec:
    return parse_job({
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "t"},
        "spec": {"model": {"preset": preset}, "globalBatchSize": batch,
                 "planner": {"allowStateOnlyRanks": allow_state_only, **planner}},
    }).spec


def with_min_gain(spec: CephaloJobSpec, min_gain: float) -> CephaloJobSpec:
    """`spec` with planner.minGainToIdleGpus set: 0 asks for the fastest choice of GPUs
    however small its gain, which is what the brute-force oracles compare against."""
    planner = spec.planner.model_copy(update={"min_gain_to_idle_gpus": min_gain})
    return spec.model_copy(update={"planner": planner})


def random_profile(rng: random.Random, product: str, spec: CephaloJobSpec,
                   capacity_bytes: int) -> GpuProfile:
    """Sub-linear then linear times (as real GPUs), memory linear in the microbatch."""
    model = spec.model.resolve()
    per_sample = rng.uniform(0.5, 3.0) * 1e-3
    base = rng.uniform(0.2, 2.0) * 1e-3
    fixed = rng.uniform(0.05, 0.3) * capacity_bytes
    mem_slope = rng.uniform(0.02, 0.25) * capacity_bytes
    points = []
    for m in range(1, 5):
        f = base + per_sample * m
        points.append(ProfilePoint(
            micro_batch_size=m, block_forward_seconds=f, block_backward_seconds=2.5 * f,
            other_forward_seconds=0.3 * f, other_backward_seconds=0.6 * f,
            compute_memory_bytes=int(fixed + mem_slope * m)))
    return GpuProfile(product=product, memory_capacity_bytes=capacity_bytes,
                      model_key=model_key(model.architecture_key(), "fp32"), points=points)


def random_instance(seed: int, max_gpus: int = 4, max_batch: int = 12):
    """(spec, cluster, profiles): 1..max_gpus GPUs of up to 3 products, tight memory so that
    both per-GPU and aggregate memory constraints bind in some instances."""
    rng = random.Random(seed)
    batch = rng.randint(1, max_batch)
    spec = job_spec(batch, allow_state_only=rng.random() < 0.7,
                    networkBandwidthGbps=rng.choice([0.01, 1.0, 100.0]))
    state = STATE_BYTES_PER_PARAMETER * spec.model.resolve().total_parameters()
    products = rng.sample(PRODUCTS, rng.randint(1, 3))
    groups, profiles = [], {}
    remaining = rng.randint(1, max_gpus)
    for i, product in enumerate(products):
        count = remaining if i == len(products) - 1 else rng.randint(0, remaining)
        remaining -= count
        if count == 0:
            continue
        # Capacity around the state size so that sharding decisions matter.
        capacity = int(state * rng.uniform(0.6, 3.0) / 0.8) + MIB
        groups.append(GpuGroup(product=product, count=count, memory_bytes=capacity))
        profiles[product] = random_profile(rng, product, spec, capacity)
    if not groups:
        groups.append(GpuGroup(product=products[0], count=1, memory_bytes=4 * state))
        profiles[products[0]] = random_profile(rng, products[0], spec, 4 * state)
    return spec, ClusterSpec(groups=groups), profiles
