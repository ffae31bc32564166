"""Planner properties: invariants, determinism, baselines, catalog, clear infeasibility."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cephalo.api import ClusterSpec, GpuGroup, Plan
from cephalo.planner import InfeasibleError, estimate_profile, evaluate, lookup_gpu, solve
from cephalo.planner.cost.catalog import GPU_CATALOG
from cephalo.planner.cost.comm_model import CommModel
from cephalo.planner.search.evaluate import water_fill

from .planner_instances import job_spec, random_instance

CLUSTER_A = ClusterSpec(groups=[
    GpuGroup(product="NVIDIA-L4", count=2), GpuGroup(product="NVIDIA-RTX-A6000", count=1),
    GpuGroup(product="Tesla-P40", count=3), GpuGroup(product="Tesla-P100-PCIE-16GB", count=2),
], network_bandwidth_bytes_per_second=50e9 / 8)


def _check_plan(plan: Plan) -> None:
    assert sum(r.batch_size for r in plan.ranks) == plan.global_batch_size
    assert abs(sum(r.shard_ratio for r in plan.ranks) - 1.0) <= 1e-9
    for r in plan.ranks:
        assert r.batch_size == r.micro_batch_size * r.num_micro_batches
        assert r.predicted_memory_bytes <= r.memory_capacity_bytes * plan.memory_fraction + 1
        assert r.predicted_step_seconds <= plan.predicted_step_seconds
    assert plan.predicted_samples_per_second == pytest.approx(
        plan.global_batch_size / plan.predicted_step_seconds)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=10**9))
@example(seed=407)  # a compute-proportional baseline once used state-only ranks the job forbade
def test_every_plan_meets_the_invariants_or_is_infeasible(seed: int) -> None:
    spec, cluster, profiles = random_instance(seed, max_gpus=6, max_batch=40)
    try:  # half the cases also choose which GPUs to use
        plan = solve(spec, cluster, profiles, choose_gpus=seed % 2 == 0)
    except InfeasibleError as err:
        assert "iB" in str(err) or "state-only" in str(err)
        return
    _check_plan(plan)
    # No baseline beats the optimum of the same model.
    for name, base in plan.baselines.items():
        if base.feasible:
            assert base.predicted_samples_per_second <= plan.predicted_samples_per_second * (
                1 + 1e-12), name
    # evaluate() of the plan's own assignment gives the plan's numbers.
    assignment: list[tuple[int, int] | None] = [None] * cluster.num_gpus
    for r in plan.ranks:
        assignment[r.gpu_index] = (r.micro_batch_size, r.num_micro_batches)
    assert sum(a is None for a in assignment) == sum(i.count for i in plan.idle_gpus)
    # Ranks are the used GPUs in cluster order: their kept blocks in the same order.
    ev = evaluate(spec, cluster, profiles, assignment,
                  kept_blocks=[r.kept_blocks for r in plan.ranks])
    assert ev.feasible and ev.step_seconds == pytest.approx(plan.predicted_step_seconds)


@pytest.mark.parametrize("preset,batch", [("gpt-2.7b", 256), ("llama-3b", 128),
                                          ("vit-g", 256), ("gpt-1.3b", 128)])
def test_cluster_a_paper_models(preset: str, batch: int) -> None:
    plan = solve(job_spec(batch, preset), CLUSTER_A)
    _check_plan(plan)
    assert [r.gpu for r in plan.ranks] == ["L4", "L4", "RTX-A6000", "P40", "P40", "P40",
                                           "P100", "P100"]
    a6000 = plan.ranks[2]
    # The A6000 is the fastest card with the most memory: most samples, and (the paper's
    # Fig. 9, ViT-G and Llama-3B) the largest shard. For GPT-2.7B/1.3B the calibrated fp32
    # estimate is nearly flat in the microbatch size (as the authors measured), so the
    # A6000 may spend its memory on one large microbatch instead of state: a P40 may then
    # hold a slightly larger shard at the same predicted step time.
    # Llama-3B: the A6000 now spends that memory keeping 5 block graphs instead (no
    # recompute for them; 26.6 s predicted instead of 27.7 s), which the paper's always-
    # recomputing system could not: its shard is the largest only when it keeps none.
    assert a6000.batch_size == max(r.batch_size for r in plan.ranks)
    if preset in ("vit-g", "llama-3b") and not a6000.kept_blocks:
        assert a6000.shard_ratio == max(r.shard_ratio for r in plan.ranks)
    if preset == "llama-3b":
        assert a6000.kept_blocks > 0 and a6000.predicted_memory_bytes == max(
            r.predicted_memory_bytes for r in plan.ranks)
    assert plan.search["exact"] is True
    assert set(plan.baselines) == {"even_fsdp", "fsdp_grad_accum", "compute_proportional",
                                   "compute_balance_only", "memory_balance_only"}


def test_plan_is_deterministic_byte_for_byte() -> None:
    first = solve(job_spec(256, "gpt-2.7b"), CLUSTER_A).to_json()
    second = solve(job_spec(256, "gpt-2.7b"), CLUSTER_A).to_json()
    assert first == second


def test_infeasible_job_says_what_is_needed_and_what_would_fit() -> None:
    cluster = ClusterSpec(groups=[GpuGroup(product="T4", count=2)])
    with pytest.raises(InfeasibleError) as err:
        solve(job_spec(64, "llama-7b"), cluster)
    msg = str(err.value)
    assert "100.4 GiB of training state" in msg
    assert "the selected GPUs offer 24.0 GiB at 80%" in msg
    assert "x T4 alone would fit" in msg


def test_gpu_too_small_for_a_single_sample_is_named() -> None:
    cluster = ClusterSpec(groups=[GpuGroup(product="T4", count=1, memory_bytes=64 * 2**20),
                                  GpuGroup(product="A10G", count=1)])
    with pytest.raises(InfeasibleError, match="T4 cannot hold"):
        solve(job_spec(8, "gpt-1.3b", allow_state_only=False), cluster)


def test_batch_smaller_than_gpus_without_state_only_ranks() -> None:
    cluster = ClusterSpec(groups=[GpuGroup(product="A10G", count=4)])
    spec = job_spec(2, allow_state_only=False)
    # On all four GPUs (chooseGpus: false) the job cannot run, and says why ...
    with pytest.raises(InfeasibleError, match="raise globalBatchSize to at least 4"):
        solve(spec, cluster, choose_gpus=False)
    # ... and the job's default (planner.chooseGpus: true) leaves two idle
    assert solve(spec, cluster).world_size <= 2
    # ... choosing the GPUs, the plan uses at most two and says which it left idle and why.
    plan = solve(spec, cluster, choose_gpus=True)
    assert plan.world_size <= 2 and all(r.batch_size >= 1 for r in plan.ranks)
    assert [(i.gpu, i.count) for i in plan.idle_gpus] == [("A10G", 4 - plan.world_size)]
    assert "does not fit on all 4 GPUs" in plan.idle_gpus[0].reason
    # State-only ranks allowed: more choices, never a slower plan.
    relaxed = solve(job_spec(2), cluster, choose_gpus=True)
    assert relaxed.predicted_step_seconds <= plan.predicted_step_seconds


def test_slow_gpu_becomes_state_only_when_that_is_faster() -> None:
    # One P40 next to an H100: any sample on the P40 would dominate the step.
    cluster = ClusterSpec(groups=[GpuGroup(product="H100", count=1),
                                  GpuGroup(product="P40", count=1)],
                          network_bandwidth_bytes_per_second=100e9)
    plan = solve(job_spec(2, "gpt-1.3b"), cluster)
    assert [r.batch_size for r in plan.ranks] == [2, 0]
    assert plan.ranks[1].shard_ratio > 0


@pytest.mark.parametrize("label,name", [
    ("NVIDIA-A10G", "A10G"), ("Tesla-T4", "T4"), ("Tesla-V100-SXM2-16GB", "V100-16GB"),
    ("NVIDIA-RTX-A6000", "RTX-A6000"), ("NVIDIA RTX A6000", "RTX-A6000"), ("P40", "P40"),
    ("Tesla-P100-PCIE-16GB", "P100"), ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA-H100-80GB-HBM3", "H100"), ("NVIDIA-L40S", "L40S"), ("h200", "H200"),
    ("NVIDIA-L4", "L4"),
])
def test_catalog_lookup(label: str, name: str) -> None:
    assert lookup_gpu(label).name == name


def test_catalog_unknown_gpu_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown GPU 'GTX-9999'.*known GPUs: P40"):
        lookup_gpu("GTX-9999")


def test_catalog_covers_the_issue_list() -> None:
    for name in ["P40", "P100", "V100-16GB", "V100-32GB", "T4", "A10G", "L4", "RTX-A6000",
                 "A100-40GB", "A100-80GB", "H100", "H200", "L40S"]:
        gpu = GPU_CATALOG[name]
        assert gpu.memory_bytes > 10 * 2**30 and gpu.fp32_tflops > 1
        assert gpu.peak_flops("bf16") >= gpu.peak_flops("fp32")


def test_water_fill_balances_utilisation() -> None:
    ratios = water_fill([1.0, 6.0, 2.0], [10.0, 10.0, 20.0], 10.0)
    assert sum(ratios) == 1.0
    used = [c + r * 10.0 for c, r in zip([1.0, 6.0, 2.0], ratios, strict=True)]
    utilisation = [u / b for u, b in zip(used, [10.0, 10.0, 20.0], strict=True)]
    # GPU 1 is already at 0.6, above the common level 13/30 the others reach: it gets nothing.
    assert ratios[1] == 0.0
    assert utilisation[0] == pytest.approx(13 / 30) and utilisation[2] == pytest.approx(13 / 30)
    assert water_fill([1.0, 1.0], [10.0, 10.0], 2.0) == [0.5, 0.5]


def test_ring_collective_model() -> None:
    comm = CommModel(bandwidth_bytes_per_second=1e9, latency_seconds=1e-5)
    assert comm.ring_seconds(1e9, 1, uneven=False) == 0.0
    assert comm.ring_seconds(1e9, 4, uneven=False) == pytest.approx(0.75 + 3e-5)
    assert comm.ring_seconds(1e9, 4, uneven=True) == pytest.approx((0.75 + 3e-5) * 1.15)


def test_estimated_profile_is_monotone_and_marked() -> None:
    model = job_spec(8, "gpt-2.7b").model.resolve()
    profile = estimate_profile("A10G", model, "fp32")
    assert profile.source == "estimated" and profile.product == "A10G"
    times = [p.block_forward_seconds for p in profile.points]
    memory = [p.compute_memory_bytes for p in profile.points]
    assert times == sorted(times) and memory == sorted(memory)
    per_sample = [t / p.micro_batch_size for t, p in zip(times, profile.points, strict=True)]
    assert per_sample == sorted(per_sample, reverse=True)  # bigger microbatches are more efficient
    bf16 = estimate_profile("A10G", model, "bf16")
    assert bf16.points[-1].block_forward_seconds < profile.points[-1].block_forward_seconds


def test_evaluate_rejects_a_wrong_length_assignment() -> None:
    with pytest.raises(ValueError, match="assignment has 1 entries for 8 GPUs"):
        evaluate(job_spec(8), CLUSTER_A, None, [(8, 1)])
