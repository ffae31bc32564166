"""The cost model's parts that the profiler measures: per-kind collective fits, the part of a
forward pass paid once per pass, and the calibration against a measured probe step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pydantic import ValidationError

from cephalo.api import ClusterSpec, GpuGroup, parse_job, preset
from cephalo.api.profile import (
    CollectiveProfile,
    GpuProfile,
    ProfilePoint,
    SingleRankStep,
    model_key,
)
from cephalo.planner.cost.catalog import lookup_gpu
from cephalo.planner.cost.comm_model import CommModel, UnitComm
from cephalo.planner.cost.costmodel import (
    GpuCostModel,
    modelled_single_rank_step_seconds,
    step_overhead_seconds,
)
from cephalo.planner.search.problem import build_problem

CONFIG = preset("gpt-tiny")


def _profile(forward: float = 1.0, backward: float = 2.0, fixed: float | None = None,
             collectives: CollectiveProfile | None = None) -> GpuProfile:
    point = ProfilePoint(micro_batch_size=1, block_forward_seconds=forward,
                         block_backward_seconds=backward, compute_memory_bytes=1000)
    return GpuProfile(product="cpu", memory_capacity_bytes=2**30,
                      model_key=model_key(CONFIG.architecture_key(), "fp32"),
                      points=[point], block_forward_fixed_seconds=fixed,
                      collectives=collectives)


def _cost(profile: GpuProfile) -> GpuCostModel:
    return GpuCostModel(lookup_gpu("cpu"), profile, 2**30, CONFIG.num_layers)


def _step(cost: GpuCostModel, ell: int, m: int, comm: UnitComm) -> float:
    return float(cost.step_seconds(np.array([ell]), np.array([m]), comm)[0])


def test_reduce_scatter_and_all_reduce_have_their_own_measurements() -> None:
    shared = CommModel(bandwidth_bytes_per_second=1e9, latency_seconds=1e-4)
    own = CommModel(bandwidth_bytes_per_second=1e9, latency_seconds=1e-4,
                    reduce_scatter_bandwidth_bytes_per_second=5e8,
                    reduce_scatter_latency_seconds=3e-4, all_reduce_seconds=7e-4)
    assert shared.ring_seconds(1e6, 2, False, "reduce_scatter") == pytest.approx(5e-4 + 1e-4)
    assert own.ring_seconds(1e6, 2, False, "reduce_scatter") == pytest.approx(1e-3 + 3e-4)
    assert own.ring_seconds(1e6, 2, False, "all_gather") == pytest.approx(5e-4 + 1e-4)
    assert shared.small_all_reduce_seconds(3) == pytest.approx(4e-4)  # 2(n-1) hops
    assert own.small_all_reduce_seconds(3) == 7e-4
    assert own.small_all_reduce_seconds(1) == 0.0


def test_forward_fixed_part_is_paid_once_per_pass() -> None:
    alone = UnitComm.build(CONFIG, CommModel(1e9, 0.0), world_size=1, uneven=False)
    plain, fixed = _cost(_profile()), _cost(_profile(fixed=0.4))
    assert _step(fixed, 1, 1, alone) == _step(plain, 1, 1, alone)  # one pass: the same
    # Three microbatches through each block save two fixed parts per block.
    saved = _step(plain, 3, 1, alone) - _step(fixed, 3, 1, alone)
    assert saved == pytest.approx(CONFIG.num_layers * 2 * 0.4)
    assert _step(fixed, 0, 1, alone) == 0.0  # a state-only GPU runs no forward at all


def test_calibration_makes_the_probe_step_exact_and_shifts_every_step() -> None:
    comm = CommModel(bandwidth_bytes_per_second=1e8, latency_seconds=1e-3, overlap_fraction=0.0)
    cost = _cost(_profile(forward=0.01, backward=0.02))
    base = UnitComm.build(CONFIG, comm, world_size=2, uneven=False)
    at_probe = _step(cost, 1, 1, base)
    calibrated = comm.calibrated(CONFIG, [cost], at_probe + 0.005, world_size=2)
    assert calibrated.step_overhead_seconds == pytest.approx(0.005)
    unit = UnitComm.build(CONFIG, calibrated, world_size=2, uneven=False)
    assert _step(cost, 1, 1, unit) == pytest.approx(at_probe + 0.005)
    assert _step(cost, 4, 1, unit) == pytest.approx(_step(cost, 4, 1, base) + 0.005)
    # A single GPU has no collectives, so nothing to calibrate.
    alone = UnitComm.build(CONFIG, calibrated, world_size=1, uneven=False)
    assert alone.step_overhead_seconds == 0.0
    # A probe faster than the model may take back at most the collectives' modelled time
    # (nothing overlaps here): the step never drops below its compute.
    faster = comm.calibrated(CONFIG, [cost], 1e-9, world_size=2)
    unit = UnitComm.build(CONFIG, faster, world_size=2, uneven=False)
    compute_only = _step(cost, 1, 1, UnitComm.build(CONFIG, comm, 1, uneven=False))
    assert _step(cost, 1, 1, unit) == pytest.approx(compute_only)


def test_planner_calibrates_with_a_measured_probe() -> None:
    spec = parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 4}}).spec
    cluster = ClusterSpec(groups=[GpuGroup(product="cpu", count=2, memory_bytes=2**30)])
    measured = CollectiveProfile(bandwidth_bytes_per_second=1e8, latency_seconds=1e-3,
                                 world_size=2, overlap_fraction=0.0)
    without = build_problem(spec, cluster, {"cpu": _profile(0.01, 0.02, None, measured)})
    assert without.comm_model.step_overhead_seconds == 0.0
    unit = UnitComm.build(CONFIG, without.comm_model, 2, uneven=False)
    predicted = _step(without.classes[0].cost, 1, 1, unit)
    probed = measured.model_copy(update={"probe_step_seconds": predicted * 1.5})
    problem = build_problem(spec, cluster, {"cpu": _profile(0.01, 0.02, None, probed)})
    assert problem.comm_model.step_overhead_seconds == pytest.approx(predicted * 0.5)



def test_a_probe_the_model_over_predicts_never_prices_a_step_below_its_compute() -> None:
    """Regression (found planning on a 5 Mbit/s link with a measured probe step): a probe step
    measured faster than the model predicts gives a negative per-step overhead, bounded by the
    probe's collectives. The probe (one sample) exposes nearly all of them; a larger step
    hides most under its compute, so the whole bound once priced such a step below its
    compute alone, negative on a slow link, and the planner chose it. A step pays at most the
    collectives every step exposes back (UnitComm.applied_overhead_seconds)."""
    spec = parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 64}}).spec
    cluster = ClusterSpec(groups=[GpuGroup(product="cpu", count=2, memory_bytes=2**30)])
    slow = CollectiveProfile(bandwidth_bytes_per_second=5e6 / 8, latency_seconds=1e-3,
                             world_size=2, overlap_fraction=0.5)
    profile = _profile(0.01, 0.02, None, slow)
    unit = UnitComm.build(CONFIG, build_problem(spec, cluster, {"cpu": profile}).comm_model, 2,
                          uneven=False)
    predicted = _step(_cost(profile), 1, 1, unit)
    probed = slow.model_copy(update={"probe_step_seconds": predicted * 0.2})
    problem = build_problem(spec, cluster, {"cpu": _profile(0.01, 0.02, None, probed)})
    assert problem.comm_model.step_overhead_seconds < 0  # the case: over-predicted
    calibrated = UnitComm.build(CONFIG, problem.comm_model, 2, uneven=False)
    silent = dataclasses.replace(calibrated, ag_block=0.0, rs_block=0.0, ag_first=0.0,
                                 ag_head=0.0, rs_other=0.0, all_reduce_seconds=0.0,
                                 step_overhead_seconds=0.0)  # its compute alone
    cost = problem.classes[0].cost
    for ell, m in [(1, 1), (4, 1), (32, 1), (8, 4), (32, 2)]:
        assert _step(cost, ell, m, calibrated) >= _step(cost, ell, m, silent) > 0, (ell, m)


def _probe(seconds: float) -> SingleRankStep:
    return SingleRankStep(seconds=seconds, num_blocks=CONFIG.num_layers,
                          parameters=CONFIG.total_parameters())


def test_planner_derives_the_step_overhead_from_the_measured_step() -> None:
    bare = _profile(forward=0.01, backward=0.02).model_copy(update={
        "optimizer_seconds_fixed": 0.003, "optimizer_seconds_per_parameter": 1e-9})
    alone = UnitComm.build(CONFIG, CommModel(1e9, 0.0), world_size=1, uneven=False)
    modelled = _step(_cost(bare), 1, 1, alone)  # no measured step: no overhead charged
    assert modelled_single_rank_step_seconds(bare) is None
    assert step_overhead_seconds(bare) == 0.0
    measured = bare.model_copy(update={"single_rank_step": _probe(modelled + 0.004)})
    # The profile holds the raw step; the planner's own prediction of it is the same step
    # the cost model scores, and what the real step took beyond it is charged to every step.
    assert modelled_single_rank_step_seconds(measured) == pytest.approx(modelled)
    assert step_overhead_seconds(measured) == pytest.approx(0.004)
    for ell in (1, 3):
        assert _step(_cost(measured), ell, 1, alone) == pytest.approx(
            _step(_cost(bare), ell, 1, alone) + 0.004)
    # A real step faster than the model (noise) never makes the model faster.
    quick = bare.model_copy(update={"single_rank_step": _probe(modelled * 0.5)})
    assert step_overhead_seconds(quick) == 0.0


def test_old_format_profiles_are_refused_so_caches_measure_again() -> None:
    old = _profile().model_dump(exclude_none=True) | {"step_overhead_seconds": 0.001}
    with pytest.raises(ValidationError, match="older format"):
        GpuProfile.model_validate(old)
    # The cache key carries the format, so an older profile is not even looked up; were it
    # found under the same name, the operator's cache read treats a ValidationError as a
    # miss (operator/profiling.py cached_profiles), as the profiler's does (tests/profiler).


def test_contention_and_emulation_scale_every_measured_time() -> None:
    from cephalo.local.emulate import Emulation, emulated_profile
    from cephalo.local.runner import slowed

    profile = _profile(fixed=0.4).model_copy(update={
        "other_forward_fixed_seconds": 0.1, "optimizer_seconds_fixed": 0.02,
        "optimizer_seconds_per_parameter": 1e-9})
    modelled = modelled_single_rank_step_seconds(profile.model_copy(
        update={"single_rank_step": _probe(1.0)}))
    assert modelled is not None
    profile = profile.model_copy(update={"single_rank_step": _probe(modelled + 0.01)})
    twice = slowed(profile, 2.0)
    for key in ("block_forward_fixed_seconds", "other_forward_fixed_seconds",
                "optimizer_seconds_fixed", "optimizer_seconds_per_parameter"):
        assert getattr(twice, key) == pytest.approx(2 * getattr(profile, key)), key
    assert twice.points[0].block_forward_seconds == 2.0
    assert twice.single_rank_step is not None
    assert twice.single_rank_step.seconds == pytest.approx(2 * (modelled + 0.01))
    assert step_overhead_seconds(twice) == pytest.approx(0.02)
    emu = Emulation(dilation={"P100": 4.0}, capacity_bytes={"P100": 2**28}, memory_scale=1.0)
    slow = emulated_profile(profile, "P100", emu, contention=1.5)
    # Unit work (including a forward pass's fixed part) runs 1.5 + 4 - 1 = 4.5x as long;
    # the step's own work and the optimizer only feel the contention.
    assert slow.points[0].block_forward_seconds == pytest.approx(4.5)
    assert slow.block_forward_fixed_seconds == pytest.approx(0.4 * 4.5)
    assert step_overhead_seconds(slow) == pytest.approx(0.015)
    assert slow.optimizer_seconds_fixed == pytest.approx(0.03)
    # The emulated real step is its dilated units, its contended optimizer and overhead.
    units = modelled - 0.02 - 1e-9 * CONFIG.total_parameters()
    assert slow.single_rank_step is not None
    assert slow.single_rank_step.seconds == pytest.approx(
        4.5 * units + 1.5 * (0.02 + 1e-9 * CONFIG.total_parameters() + 0.01))


def test_the_operator_measures_again_over_an_old_format_cache_entry() -> None:
    """A ConfigMap holding an older profile under the current name (it cannot have that
    name, the key carries the format; this is the fallback) counts as a cache miss."""
    import asyncio
    from types import SimpleNamespace

    from cephalo.api import CephaloJob
    from cephalo.operator.discovery import Pool
    from cephalo.operator.profiling import cached_profiles
    from cephalo.operator.render import PROFILE_KEY

    job = CephaloJob.model_validate({
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8}})
    current = _profile().to_compact_json()
    old = _profile().model_dump(exclude_none=True) | {"step_overhead_seconds": 0.001}
    stored = {"cpu": current, "T4": json.dumps(old)}

    async def get(path: str) -> dict:
        product = "cpu" if "cephalo-profile-cpu-" in path else "T4"
        return {"data": {PROFILE_KEY: stored[product]}}

    ctx = SimpleNamespace(job=job, config=None, namespace="ns", kube=SimpleNamespace(get=get),
                          body={"metadata": {}})
    pools = [Pool(product=p, catalog_name=p, num_gpus=1, memory_bytes=None, nodes=("n",))
             for p in ("cpu", "T4")]
    found, missing = asyncio.run(cached_profiles(ctx, pools))  # type: ignore[arg-type]
    assert list(found) == ["cpu"] and [p.product for p in missing] == ["T4"]


def test_compute_seconds_are_kept_read_only_and_the_same_as_fresh_ones() -> None:
    """The searches ask for the same sizes for every candidate: the answer is kept (by the
    sizes' values, whatever their dtype), shared read-only, also by the no-recompute copy,
    and equal to what a fresh model computes."""
    points = [ProfilePoint(micro_batch_size=m, block_forward_seconds=0.1 * m + 0.05,
                           block_backward_seconds=0.25 * m, compute_memory_bytes=1000 * m)
              for m in (1, 2, 4)]
    profile = _profile().model_copy(update={"points": points})
    cost = _cost(profile)
    first = cost.compute_seconds(np.array([1, 3, 6]))
    assert cost.compute_seconds(np.array([1.0, 3.0, 6.0])) is first
    assert cost.without_recompute(CONFIG).compute_seconds(np.array([1, 3, 6])) is first
    with pytest.raises(ValueError, match="read-only"):
        first[0, 0] = 0.0
    fresh = _cost(profile).compute_seconds(np.array([6, 3, 1]))
    assert np.array_equal(first, fresh[:, ::-1])
    assert first[0].tolist() == pytest.approx([0.15, 0.35, 0.65])  # 6: extrapolated
    assert UnitComm.build(CONFIG, CommModel(1e9, 1e-5), 3, True) is \
        UnitComm.build(CONFIG, CommModel(1e9, 1e-5), 3, True)
