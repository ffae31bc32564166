"""Activation offload as a per-rank plan decision (cephalo.planner.search.offload): kept on the
device where the boundaries fit, offloaded where they do not, never on a CPU, and the
transfers the compute does not hide priced into the rank's step."""

from __future__ import annotations

import itertools

import pytest

from cephalo.api import ClusterSpec, GpuGroup, memory
from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.api.plan import Plan, RankPlan
from cephalo.planner import estimate_profile, lookup_gpu, solve
from cephalo.planner.cost.catalog import GPU_CATALOG, resolve_gpu
from cephalo.planner.search.offload import (
    DEFAULT_HOST_LINK_BYTES_PER_SECOND,
    OffloadDecision,
    apply_offload,
    boundary_activations_line,
    decide_offload,
    host_link_bytes_per_second,
    offload_plan,
    transfer_extra_seconds,
    transfers_per_microbatch,
)
from cephalo.planner.search.problem import build_problem

from .planner_instances import job_spec

GIB = 1024**3
GPT_13B = preset("gpt-1.3b")  # 24 layers, hidden 2048, 512 tokens
# 2 L4 (faster, more samples) and 2 P40 of the same memory, ample network.
MIXED = ClusterSpec(groups=[GpuGroup(product="NVIDIA-L4", count=2),
                            GpuGroup(product="Tesla-P40", count=2)],
                    network_bandwidth_bytes_per_second=50e9 / 8)


def _boundaries(model, samples: int) -> int:  # type: ignore[no-untyped-def]
    return memory.kept_boundary_bytes(model.num_layers, samples, model.tokens_per_sample,
                                      model.hidden_size, offload=False)


def _decide(**overrides: object) -> OffloadDecision:
    args: dict[str, object] = dict(
        budget_bytes=20 * GIB, memory_bytes=10 * GIB, model=GPT_13B, micro_batch_size=2,
        num_micro_batches=3, compute_seconds=[0.05, 0.15, 0.02, 0.04],
        bandwidth_bytes_per_second=24e9, product="L4")
    args.update(overrides)
    return decide_offload(**args)  # type: ignore[arg-type]


def test_boundaries_that_fit_stay_on_the_device() -> None:
    need = _boundaries(GPT_13B, 6)  # 26 boundaries of 6 samples x 512 x 2048 fp32: 624 MiB
    assert need == 26 * 6 * 512 * 2048 * 4
    d = _decide(memory_bytes=20 * GIB - need)  # exactly full still fits
    assert (d.offload, d.fits, d.boundary_bytes, d.device_bytes) == (False, True, need, need)
    assert d.extra_seconds == 0.0


def test_boundaries_that_do_not_fit_are_offloaded() -> None:
    need = _boundaries(GPT_13B, 6)
    d = _decide(memory_bytes=20 * GIB - need + 1)
    assert (d.offload, d.fits, d.boundary_bytes, d.device_bytes) == (True, False, need, 0)
    # 8 MiB a boundary at 24 GB/s: 0.35 ms a transfer, far under 50 ms of a block's forward.
    assert d.extra_seconds == 0.0


def test_a_cpu_rank_never_offloads() -> None:
    need = _boundaries(GPT_13B, 6)
    for product in ("cpu", "CPU"):
        d = _decide(memory_bytes=20 * GIB, product=product)
        assert (d.offload, d.fits, d.device_bytes) == (False, False, need)


def test_no_recompute_and_state_only_ranks_have_nothing_to_decide() -> None:
    # Without recompute the kept graphs hold the boundaries (counted in kept_graph_bytes).
    assert _decide(memory_bytes=20 * GIB, recompute=False) == OffloadDecision(False, 0, True)
    assert _decide(micro_batch_size=0, num_micro_batches=0) == OffloadDecision(False, 0, True)


def test_transfers_slower_than_compute_cost_exactly_the_difference() -> None:
    model = preset("gpt-tiny").model_copy(update={"num_layers": 2, "hidden_size": 16,
                                                  "sequence_length": 8})
    one = memory.boundary_bytes(2, 8, 16)
    assert one == 1024
    f, b, fo, bo = 0.25, 2.0, 0.1, 0.5
    # One transfer takes 1 s. Per microbatch (x3): each block sends its input in the
    # forward (1 s against 0.25), and in the backward brings input and gradient back and
    # sends its input's gradient (3 s against 2); head and embedding 2 s against 0.5.
    fwd, bwd = transfer_extra_seconds(2, 2, 3, 8, 16, [f, b, fo, bo], 1024.0)
    assert fwd == pytest.approx(3 * 2 * 0.75)
    assert bwd == pytest.approx(3 * (2 * 1.0 + 1.5))
    # The last block keeps its graph: no input sent in the forward, only the gradients
    # (2 s) against its backward without recompute (b - f = 1.75).
    fwd, bwd = transfer_extra_seconds(2, 2, 3, 8, 16, [f, b, fo, bo], 1024.0, kept_blocks=1)
    assert fwd == pytest.approx(3 * 1 * 0.75)
    assert bwd == pytest.approx(3 * (1.0 + 0.25 + 1.5))
    # With no compute to hide under, every copy of transfers_per_microbatch shows.
    fwd, bwd = transfer_extra_seconds(2, 2, 3, 8, 16, [0, 0, 0, 0], 1024.0, kept_blocks=1)
    assert fwd + bwd == pytest.approx(3 * sum(transfers_per_microbatch(2, 1)))
    d = decide_offload(budget_bytes=100, memory_bytes=0, model=model, micro_batch_size=2,
                       num_micro_batches=3, compute_seconds=[f, b, fo, bo],
                       bandwidth_bytes_per_second=1024.0, product="T4", kept_blocks=1)
    assert d.offload and d.extra_seconds == pytest.approx(2.25 + 8.25)
    # Both blocks in the fused tail: they copy nothing of their own; the tail's input
    # gradient goes out and the embedding brings it back (2 s against 0.5).
    fwd, bwd = transfer_extra_seconds(2, 2, 3, 8, 16, [f, b, fo, bo], 1024.0, kept_blocks=2,
                                      fused_blocks=2)
    assert (fwd, bwd) == (0.0, pytest.approx(3 * 1.5))
    fwd, bwd = transfer_extra_seconds(2, 2, 3, 8, 16, [0, 0, 0, 0], 1024.0, kept_blocks=2,
                                      fused_blocks=2)
    assert fwd + bwd == pytest.approx(3 * sum(transfers_per_microbatch(2, 2, 2)))


def test_a_fused_tail_keeps_no_boundaries_of_its_own() -> None:
    layers = GPT_13B.num_layers
    one_set = memory.boundary_bytes(6, GPT_13B.tokens_per_sample, GPT_13B.hidden_size)
    # The tail's input and one gradient in flight, for every sample.
    d = _decide(memory_bytes=0, kept_blocks=layers, fused_blocks=layers)
    assert (d.offload, d.boundary_bytes) == (False, 2 * one_set)
    d = _decide(memory_bytes=0, kept_blocks=layers, fused_blocks=layers - 4)
    assert d.boundary_bytes == 6 * one_set


def test_the_transfer_count_is_what_the_engine_copies() -> None:
    """The engine's activation store on CPU (plain copies, same bookkeeping as CUDA):
    what it sends to host in one step is transfers_per_microbatch's count of boundaries,
    with layered kept blocks (one microbatch) and with a fused tail (three)."""
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine, Layout

    config = preset("gpt-tiny")
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    one = memory.boundary_bytes(2, config.tokens_per_sample, config.hidden_size)
    fused = {}
    for batch, kept in itertools.product((2, 6), range(config.num_layers + 1)):
        engine = Engine(config, TrainingSpec(),
                        Layout([batch], [2], [1.0], kept_blocks=[kept]),
                        offload=True, standalone=True)
        brought_back: list[bool] = []
        prefetch = engine.store.prefetch

        def counting(key, prefetch=prefetch, store=engine.store,  # type: ignore[no-untyped-def]
                     seen=brought_back):
            seen.append(key in store._host)  # on host: this call copies it back
            prefetch(key)

        engine.store.prefetch = counting  # type: ignore[method-assign]
        engine.step(data.micro_batches(0, 0, batch, 2))
        to_host, to_device = transfers_per_microbatch(config.num_layers, kept,
                                                      engine.fused_tail)
        micro_batches = batch // 2
        assert engine.store.offloaded_bytes == micro_batches * to_host * one, (batch, kept)
        assert sum(brought_back) == micro_batches * to_device, (batch, kept)
        # The planner, which cannot count a fused tail, never counts fewer.
        assert transfers_per_microbatch(config.num_layers, kept) >= (to_host, to_device)
        fused[batch, kept] = engine.fused_tail
    # One microbatch: kept blocks stay layered; three: every kept block runs per microbatch.
    assert fused == {(2, 0): 0, (2, 1): 0, (2, 2): 0, (6, 0): 0, (6, 1): 1, (6, 2): 2}


def test_host_link_comes_from_the_profile_then_the_catalog() -> None:
    t4, h200 = lookup_gpu("Tesla-T4"), lookup_gpu("NVIDIA-H200")
    model = preset("gpt-tiny")
    measured = estimate_profile(t4, model, "fp32").model_copy(
        update={"host_link_bytes_per_second": 9.5e9})
    assert host_link_bytes_per_second(measured, t4) == 9.5e9
    assert host_link_bytes_per_second(estimate_profile(t4, model, "fp32"), t4) == 12e9
    assert host_link_bytes_per_second(None, h200) == 48e9
    assert host_link_bytes_per_second(None, lookup_gpu("A10G")) == 24e9
    unknown = resolve_gpu("NVIDIA-GeForce-RTX-4090", 24 * GIB)
    assert host_link_bytes_per_second(None, unknown) == DEFAULT_HOST_LINK_BYTES_PER_SECOND
    assert all(g.host_link_gbps for name, g in GPU_CATALOG.items() if name != "cpu")


def _mixed_plan(fraction: float) -> tuple[Plan, Plan, object]:
    spec = job_spec(16, preset="gpt-1.3b", memoryFraction=fraction)
    plan = solve(spec, MIXED, choose_gpus=False)
    return plan, offload_plan(plan, build_problem(spec, MIXED)), spec


def test_a_real_plan_offloads_exactly_where_the_boundaries_do_not_fit() -> None:
    mixed = None
    for fraction in (0.8, 0.7, 0.9, 0.6):
        before, after, _ = _mixed_plan(fraction)
        decided = {r.offload_activations for r in after.ranks}
        assert None not in decided
        if decided == {True, False}:
            mixed = (fraction, before, after)
            break
    assert mixed is not None, "no memory fraction gave one rank that offloads, one that keeps"
    fraction, before, after = mixed
    model = preset("gpt-1.3b")
    for b, a in zip(before.ranks, after.ranks, strict=True):
        budget = a.memory_capacity_bytes * fraction
        need = _boundaries(model, b.batch_size)
        assert a.offload_activations == (b.predicted_memory_bytes + need > budget)
        assert a.predicted_memory_bytes <= budget
        expected = b.predicted_memory_bytes + (0 if a.offload_activations else need)
        assert a.predicted_memory_bytes == expected
        assert a.predicted_step_seconds >= b.predicted_step_seconds
    assert after.predicted_step_seconds == max(r.predicted_step_seconds for r in after.ranks)
    assert after.predicted_samples_per_second == pytest.approx(
        after.global_batch_size / after.predicted_step_seconds)
    # It serialises and round-trips for the trainer.
    again = Plan.model_validate_json(after.to_json())
    assert [r.offload_activations for r in again.ranks] == \
        [r.offload_activations for r in after.ranks]
    line = boundary_activations_line(after)
    assert line.startswith("boundary activations: kept on the device (rank")
    assert "offloaded to host (rank" in line and "would not fit" in line


def test_a_slow_measured_link_is_priced_into_the_step_and_noted() -> None:
    spec = job_spec(16, preset="gpt-1.3b", memoryFraction=0.8)
    model = spec.model.resolve()
    # A measured profile per GPU, the same as the estimate but with a 100 MB/s host link:
    # the offloading ranks' transfers no longer hide.
    profiles = {name: estimate_profile(lookup_gpu(name), model, "fp32").model_copy(
        update={"host_link_bytes_per_second": 1e8}) for name in ("L4", "P40")}
    plan = solve(spec, MIXED, profiles, choose_gpus=False)
    problem = build_problem(spec, MIXED, profiles)
    after = offload_plan(plan, problem)
    off = [r for r in after.ranks if r.offload_activations]
    assert off
    for r in off:
        before = plan.ranks[r.rank]
        cost = problem.rank_cost(r.rank)
        f, b, fo, bo = cost.compute_seconds([r.micro_batch_size])[:, 0]
        fwd, bwd = transfer_extra_seconds(
            model.num_layers, r.micro_batch_size, r.num_micro_batches,
            model.tokens_per_sample, model.hidden_size, [f, b, fo, bo], 1e8, r.kept_blocks)
        assert fwd + bwd > 0
        assert r.predicted_step_seconds == pytest.approx(before.predicted_step_seconds +
                                                         fwd + bwd)
        assert any(n.startswith(f"rank {r.rank} ({r.gpu}) offloads") for n in after.notes)
    assert after.predicted_step_seconds > plan.predicted_step_seconds
    assert "transfers add up to" in boundary_activations_line(after)


def test_a_plan_without_recompute_keeps_everything_on_the_device() -> None:
    spec = job_spec(8, preset="gpt-small")
    cluster = ClusterSpec(groups=[GpuGroup(product="NVIDIA-RTX-A6000", count=2)])
    plan = solve(spec, cluster, choose_gpus=False)
    assert plan.recompute is False
    after = offload_plan(plan, build_problem(spec, cluster))
    assert all(r.offload_activations is False for r in after.ranks)
    assert [r.predicted_memory_bytes for r in after.ranks] == \
        [r.predicted_memory_bytes for r in plan.ranks]
    assert boundary_activations_line(after).endswith("(the kept graphs hold them)")


def test_a_cpu_rank_that_keeps_more_than_its_budget_says_so() -> None:
    plan = Plan(global_batch_size=4, world_size=2, predicted_step_seconds=1.0,
                predicted_samples_per_second=4.0, ranks=[
                    RankPlan(rank=i, gpu="cpu", batch_size=2, micro_batch_size=2,
                             num_micro_batches=1, shard_ratio=0.5, predicted_step_seconds=1.0,
                             predicted_memory_bytes=100, memory_capacity_bytes=1000)
                    for i in range(2)])
    decisions = [OffloadDecision(False, 50, True), OffloadDecision(False, 5000, False)]
    after = apply_offload(plan, decisions, [12e9, 12e9])
    assert [r.predicted_memory_bytes for r in after.ranks] == [150, 5100]
    assert after.notes == ["rank 1 (cpu) keeps its boundary activations (0.0 MiB) in host "
                           "memory, beyond its planned budget"]
    assert after.predicted_step_seconds == 1.0
    assert boundary_activations_line(after) == "boundary activations: kept on the device " \
                                               "(ranks 0-1)"
    # A hand-written plan says nothing: the engine's default.
    assert boundary_activations_line(plan) == "boundary activations: the engine's default: " \
                                              "offloaded on a GPU, kept on a CPU (ranks 0-1)"


def test_the_host_link_is_not_measured_off_cuda() -> None:
    import torch

    from cephalo.trainer.host_link import measure_host_link_bytes_per_second

    assert measure_host_link_bytes_per_second(torch.device("cpu")) is None


@pytest.mark.gpu
def test_the_host_link_measures_a_pcie_rate_on_cuda() -> None:
    import torch

    from cephalo.trainer.host_link import measure_host_link_bytes_per_second

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.raises(ValueError, match="repeats"):
        measure_host_link_bytes_per_second(torch.device("cuda"), repeats=0)
    rate = measure_host_link_bytes_per_second(torch.device("cuda"))
    # Anything from a PCIe 3.0 x4 riser to PCIe 5.0 x16 or NVLink-C2C (Grace Hopper).
    assert rate is not None and 2e9 < rate < 500e9, rate
