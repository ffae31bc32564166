"""The timing split from rank 0's page to status.progress.timing: the trainer's own
Prometheus series (cephalo.trainer.metrics, real prometheus_client output) parsed by the
operator's progress scrape; a page missing a rank or carrying a non-finite sum has none."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from cephalo.api.replan import MAX_TIMED_RANKS
from cephalo.api.status import Progress
from cephalo.operator.progress import parse_progress_checked
from cephalo.trainer.metrics import TrainerMetrics


def _page(steps: list[tuple[float, list[float], list[float]]], rank: int = 0) -> str:
    metrics = TrainerMetrics(rank, 0, None)
    for step_seconds, compute, wait in steps:
        metrics.time_ranks(step_seconds, compute, wait)
    return generate_latest(metrics.registry).decode()


def test_means_over_the_timed_steps_reach_status() -> None:
    page = _page([(0.5, [0.1, 0.2], [0.3, 0.1]), (0.7, [0.3, 0.2], [0.3, 0.5])])
    timing = parse_progress_checked(page)["timing"]
    assert timing["steps"] == 2 and timing["stepSeconds"] == pytest.approx(0.6)
    assert timing["computeSeconds"] == pytest.approx([0.2, 0.2])
    assert timing["waitSeconds"] == pytest.approx([0.3, 0.3])
    Progress.model_validate({"timing": timing})  # what the CRD's status schema takes


def test_no_split_no_timing() -> None:
    assert "timing" not in parse_progress_checked(_page([]))  # no timed step yet
    assert "timing" not in parse_progress_checked(_page([(0.5, [0.1], [0.2])], rank=1))
    too_many = [0.1] * (MAX_TIMED_RANKS + 1)
    assert "timing" not in parse_progress_checked(_page([(0.5, too_many, too_many)]))
    page = _page([(0.5, [0.1, 0.2], [0.3, 0.1])])
    missing = "\n".join(line for line in page.splitlines()
                        if 'cephalo_rank_wait_seconds_total{of_rank="1"' not in line) + "\n"
    assert "timing" not in parse_progress_checked(missing)
    nan = page.replace('cephalo_timed_step_seconds_total{rank="0"} 0.5',
                       'cephalo_timed_step_seconds_total{rank="0"} NaN')
    assert nan != page and "timing" not in parse_progress_checked(nan)


def test_replan_settings_restart_no_rank() -> None:
    """spec.planner.replan is the operator's policy, like spec.elastic: editing it leaves
    the ranks' config hash as it was (no re-plan, no restart)."""
    from cephalo.api import ClusterSpec, GpuGroup, parse_job
    from cephalo.operator.render import config_hash
    from cephalo.planner import solve

    def job(**planner: object) -> object:
        return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                          "metadata": {"name": "t", "uid": "u"},
                          "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                                   "planner": planner}})

    plain = job()
    plan = solve(plain.spec, ClusterSpec(groups=[GpuGroup(product="A10G", count=1)]))
    opted_out = job(replan={"enabled": False, "minGain": 0.5})
    assert config_hash(opted_out, plan) == config_hash(plain, plan)
    assert config_hash(job(memoryFraction=0.5, replan={"enabled": False}), plan) == \
        config_hash(job(memoryFraction=0.5), plan) != config_hash(plain, plan)


# A CI run's figures (test_operator_prometheus: ranks on the CPU, planned for an L4 and an
# A10G): the re-plan promised +32 % and the re-planned gang measured +2.5 %. Without the
# check the next calibration re-planned again, every ~5 s, each time promising a gain.
REPLANNED = {"replans": 1, "lastCalibration": {
    "verdict": "Replan", "measuredStepSeconds": 0.0247, "calibratedStepSeconds": 0.0247,
    "candidateStepSeconds": 0.0188}}


def test_a_replan_that_delivered_less_than_min_gain_stops_replanning() -> None:
    from cephalo.operator.replan import delivered_gain, replan_stop

    gain = delivered_gain(REPLANNED, 0.0241)
    assert gain == pytest.approx(0.0247 / 0.0241 - 1)
    code, why = replan_stop(REPLANNED, gain, min_gain=0.1, max_replans=3) or ("", "")
    assert code == "ReplanDidNotPay", why
    assert "predicted +31%" in why and "measured +2%" in why and "minGain 10%" in why, why
    # Stopped for good: a later plan (another calibration) re-plans no more either.
    later = {**REPLANNED, "stopped": why, "lastCalibration": {"verdict": "Keep"}}
    assert delivered_gain(later, 0.01) is None
    assert replan_stop(later, None, 0.1, 3) == ("ReplanStopped", why)


def test_a_replan_that_delivered_may_be_followed_by_another_up_to_max_replans() -> None:
    from cephalo.operator.replan import delivered_gain, replan_stop

    gain = delivered_gain(REPLANNED, 0.0188)  # the promised +31 % came
    assert gain == pytest.approx(0.0247 / 0.0188 - 1)
    assert replan_stop(REPLANNED, gain, 0.1, max_replans=3) is None
    assert replan_stop(REPLANNED, gain, 0.1, max_replans=1) == (
        "ReplanLimit", "1 re-plan(s) made, spec.planner.replan.maxReplans is 1")
    assert replan_stop({}, None, 0.1, max_replans=0)[0] == "ReplanLimit"  # type: ignore[index]
    # Only the first calibration after a re-plan judges it; a kept plan's next one does not.
    assert delivered_gain({"lastCalibration": {"verdict": "Keep",
                                               "measuredStepSeconds": 1.0}}, 2.0) is None


def _four_rank_plan() -> object:
    from cephalo.api import ClusterSpec, GpuGroup
    from cephalo.api.job import CephaloJobSpec
    from cephalo.planner import solve

    spec = CephaloJobSpec.model_validate({"model": {"preset": "gpt-small"},
                                          "globalBatchSize": 32, "planner": {
                                              "minGainToIdleGpus": 0.0,
                                              "networkBandwidthGbps": 1000.0,
                                              "networkLatencyMicroseconds": 1.0}})
    plan = solve(spec, ClusterSpec(groups=[GpuGroup(product="A10G", count=2),
                                           GpuGroup(product="T4", count=2)]))
    assert plan.world_size == 4 and all(r.batch_size > 1 for r in plan.ranks)
    return plan


def test_replan_reads_the_split_in_force_only_when_it_is_the_plans_batch_moved() -> None:
    from cephalo.api.plan import Plan
    from cephalo.operator.replan import split_in_force

    plan = _four_rank_plan()
    assert isinstance(plan, Plan)
    planned = [r.batch_size for r in plan.ranks]
    moved = [planned[0] + 1, planned[1] - 1, *planned[2:]]
    assert split_in_force({"batchSizes": moved}, plan) == moved
    assert split_in_force({"batchSizes": planned}, plan) is None  # the plan's own
    assert split_in_force(None, plan) is None
    assert split_in_force({"batchSizes": [*moved, 0]}, plan) is None  # another gang's
    assert split_in_force({"batchSizes": [moved[0] + 1, *moved[1:]]}, plan) is None


def test_a_plan_differing_only_in_its_split_is_a_rebalances_move() -> None:
    from cephalo.api.plan import Plan
    from cephalo.operator.replan import only_split_differs

    plan = _four_rank_plan()
    assert isinstance(plan, Plan)
    a, b, *rest = plan.ranks
    moved = plan.model_copy(update={"ranks": [
        a.model_copy(update={"batch_size": a.batch_size + 1}),
        b.model_copy(update={"batch_size": b.batch_size - 1}), *rest]})
    assert only_split_differs(plan, moved)
    other_micro = plan.model_copy(update={"ranks": [
        a.model_copy(update={"micro_batch_size": a.micro_batch_size + 1}), b, *rest]})
    assert not only_split_differs(plan, other_micro)
    other_shards = plan.model_copy(update={"ranks": [
        a.model_copy(update={"shard_ratio": a.shard_ratio / 2}), b, *rest]})
    assert not only_split_differs(plan, other_shards)
    one_gpu = plan.model_copy(update={"ranks": [a], "world_size": 1})
    assert not only_split_differs(plan, one_gpu)


def test_with_live_rebalancing_a_calibration_waits_for_a_settled_split() -> None:
    from cephalo.api.job import CephaloJobSpec
    from cephalo.operator.replan import _timed_steps_needed

    def spec(rebalance: dict[str, object]) -> CephaloJobSpec:
        return CephaloJobSpec.model_validate({
            "model": {"preset": "gpt-tiny"}, "globalBatchSize": 16,
            "planner": {"replan": {"afterSteps": 5}, "rebalance": rebalance}})

    plan = _four_rank_plan()
    assert _timed_steps_needed(spec({"enabled": False}), plan) == 5
    # The timing restarts at each change: a split timed past one interval outlived a
    # decision (the one rebalancing settled on).
    assert _timed_steps_needed(spec({"enabled": True, "intervalSteps": 10}), plan) == 11
    assert _timed_steps_needed(spec({"enabled": True, "intervalSteps": 2}), plan) == 5


def test_a_gang_with_no_split_to_move_calibrates_after_its_steps_alone() -> None:
    """Regression (a fresh-clone CI run): a one-GPU job of 12 steps waited for the default
    rebalancing interval's 11 timed steps, never calibrated, and its PredictionOff test on
    the real control plane failed: one rank has no split for rebalancing to settle."""
    from cephalo.api.job import CephaloJobSpec
    from cephalo.operator.replan import _timed_steps_needed

    spec = CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-tiny"}, "globalBatchSize": 16,
        "planner": {"replan": {"afterSteps": 3}}})  # rebalancing on, interval 10: defaults
    plan = _four_rank_plan()
    one = plan.model_copy(update={"ranks": [plan.ranks[0].model_copy(update={
        "batch_size": plan.global_batch_size, "shard_ratio": 1.0, "num_micro_batches":
        plan.global_batch_size // plan.ranks[0].micro_batch_size})], "world_size": 1})
    assert _timed_steps_needed(spec, one) == 3
    assert _timed_steps_needed(spec, plan) == 11


def test_the_next_calibration_knows_what_the_last_one_measured_per_gpu_type() -> None:
    from cephalo.operator.replan import known_compute_scale

    state = {"lastCalibration": {**REPLANNED["lastCalibration"],
                                 "computeScale": {"NVIDIA-A10G": 2.5, "NVIDIA-L4": 1}}}
    assert known_compute_scale(state) == {"NVIDIA-A10G": 2.5, "NVIDIA-L4": 1.0}
    assert known_compute_scale({}) == {}  # the job's first calibration
    assert known_compute_scale({"lastCalibration": {"verdict": "Keep"}}) == {}
    assert known_compute_scale({"lastCalibration": {"computeScale": {"T4": "x"}}}) == {}
