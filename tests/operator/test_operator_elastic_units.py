"""The elastic scaling decision (cephalo.operator.elastic, pure): when a running job grows
onto more GPUs, and when it does not — with the planner's own predictions where a test
needs real figures."""

from __future__ import annotations

import dataclasses

import pytest
from kube_fixtures import gpu_node, job_body

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.api.elastic import DEFAULT_RESTART_COST_SECONDS, ElasticSpec
from cephalo.operator.discovery import discover_pools, select_cluster
from cephalo.operator.elastic import (
    COOLDOWN,
    GAIN_BELOW_MINIMUM,
    RESCALE,
    SAVING_BELOW_RESTART_COST,
    RescaleInputs,
    announce,
    capped_spec,
    decide,
    offers_more,
    record_restart,
    restart_cost,
    should_evaluate,
)
from cephalo.planner import solve

BASE = RescaleInputs(now=1000.0, current_gpus=4, candidate_gpus=8,
                     current_samples_per_second=100.0, candidate_samples_per_second=190.0,
                     measured_samples_per_second=None, global_batch_size=64,
                     remaining_steps=1000, restart_cost_seconds=120.0,
                     restart_cost_measured=False, min_gain=0.1, cooldown_seconds=300.0,
                     last_rescale_at=None)


def test_a_large_gain_over_many_remaining_steps_rescales_with_its_figures() -> None:
    d = decide(BASE)
    assert (d.verdict, d.code) == ("Rescale", RESCALE)
    assert d.gain == pytest.approx(0.9)
    # 1000 steps of 0.64 s now, each 100/190 as long after: 303 s saved
    assert d.saved_seconds == pytest.approx(1000 * 0.64 * (1 - 100 / 190))
    assert "4 -> 8 GPUs" in d.reason and "+90%" in d.reason and "120.0 s (assumed)" in d.reason


def test_a_gain_below_the_minimum_is_skipped_however_long_the_run() -> None:
    d = decide(dataclasses.replace(BASE, candidate_samples_per_second=105.0,
                                   remaining_steps=10**7))
    assert (d.verdict, d.code) == ("Skip", GAIN_BELOW_MINIMUM)
    assert d.retry_at is None and "below the minimum gain 10%" in d.reason
    slower = decide(dataclasses.replace(BASE, candidate_samples_per_second=90.0))
    assert slower.code == GAIN_BELOW_MINIMUM and slower.gain < 0
    assert decide(dataclasses.replace(BASE, candidate_samples_per_second=110.0,
                                      remaining_steps=10**4)).verdict == \
        "Rescale"  # exactly the minimum is enough


def test_a_restart_that_costs_more_than_it_saves_is_skipped() -> None:
    d = decide(dataclasses.replace(BASE, restart_cost_seconds=400.0,
                                   restart_cost_measured=True))
    assert (d.verdict, d.code) == ("Skip", SAVING_BELOW_RESTART_COST)
    assert "400.0 s (measured)" in d.reason and d.retry_at is None


def test_near_the_end_of_the_run_the_saving_is_too_small() -> None:
    d = decide(dataclasses.replace(BASE, remaining_steps=50))  # 15 s saved < 120 s
    assert d.code == SAVING_BELOW_RESTART_COST and d.saved_seconds < 120
    assert decide(dataclasses.replace(BASE, remaining_steps=0)).code == \
        SAVING_BELOW_RESTART_COST


def test_the_saving_uses_the_measured_step_time() -> None:
    """Predictions are only trusted as a ratio: a job measured 4x slower than predicted
    saves 4x the seconds (and the same restart cost then pays off sooner)."""
    predicted = decide(dataclasses.replace(BASE, remaining_steps=300))
    measured = decide(dataclasses.replace(BASE, remaining_steps=300,
                                          measured_samples_per_second=25.0))
    assert predicted.code == SAVING_BELOW_RESTART_COST
    assert measured.verdict == "Rescale"
    assert measured.saved_seconds == pytest.approx(4 * predicted.saved_seconds)


def test_within_the_cooldown_it_waits_and_says_until_when() -> None:
    d = decide(dataclasses.replace(BASE, last_rescale_at=900.0))
    assert (d.verdict, d.code) == ("Skip", COOLDOWN) and d.retry_at == 1200.0
    assert "100 s ago (cooldown 300 s)" in d.reason
    after = decide(dataclasses.replace(BASE, now=1200.0, last_rescale_at=900.0))
    assert after.verdict == "Rescale"
    # a final verdict wins over the cooldown: no retry for an offer that can never pay
    assert decide(dataclasses.replace(BASE, last_rescale_at=900.0,
                                      candidate_samples_per_second=101.0)).retry_at is None


def test_restart_cost_is_the_largest_measurement_else_the_default() -> None:
    assert restart_cost(None) == (DEFAULT_RESTART_COST_SECONDS, False)
    assert restart_cost([], 7.0) == (7.0, False)
    assert restart_cost([12.0, 30.5, 9.0], 7.0) == (30.5, True)
    kept = record_restart([1.0, 2.0, 3.0, 4.0, 5.0], 6.12345)
    assert kept == [2.0, 3.0, 4.0, 5.0, 6.123]


def test_an_offer_is_planned_once_unless_a_cooldown_ends() -> None:
    offer = {"NVIDIA-A10G": 8}
    assert offers_more({"NVIDIA-A10G": 4}, offer)
    assert not offers_more({"NVIDIA-A10G": 4}, {"NVIDIA-A10G": 4})
    assert offers_more({"NVIDIA-A10G": 4}, {"NVIDIA-A10G": 4, "Tesla-T4": 1})  # rebalance
    assert should_evaluate(offer, None, None, None, 0.0)
    assert not should_evaluate(offer, {"NVIDIA-A10G": 8}, "Skip", None, 10.0)  # final
    assert should_evaluate(offer, {"NVIDIA-A10G": 6}, "Skip", None, 10.0)  # a new offer
    assert should_evaluate(offer, offer, "Rescale", None, 10.0)  # the plan changed since
    assert not should_evaluate(offer, offer, "Skip", 20.0, 10.0)
    assert should_evaluate(offer, offer, "Skip", 20.0, 20.0)  # the cooldown ended


def test_a_flapping_node_causes_at_most_one_rescale_and_few_events() -> None:
    """Five flaps of a node of 4 GPUs beside a job on 4: the job grows once; while the node
    is away the job re-plans down (GPUs lost, not a rescale), and each time it is back the
    cooldown holds. Events: one Rescaled, one RescaleSkipped, nothing per flap."""
    now, last_rescale, plan_gpus = 0.0, None, 4
    last: tuple[str | None, str | None] = (None, None)
    last_offer: dict[str, int] | None = None
    retry: float | None = None
    rescales = events = 0
    for _flap in range(5):
        now += 20.0
        offer = {"pool": 8}  # the node is Ready: 4 of the job's own + 4 free
        if offers_more({"pool": plan_gpus}, offer) and should_evaluate(offer, last_offer,
                                                                       last[0], retry, now):
            d = decide(dataclasses.replace(BASE, now=now, last_rescale_at=last_rescale))
            events += announce(last, d)
            last, last_offer, retry = (d.verdict, d.code), offer, d.retry_at
            if d.verdict == "Rescale":
                rescales, last_rescale, plan_gpus = rescales + 1, now, 8
        now += 20.0
        plan_gpus = 4  # NotReady: the job re-plans on what is left
    assert rescales == 1 and events == 2 and last == ("Skip", COOLDOWN)


def test_max_gpus_caps_what_an_elastic_job_plans_on() -> None:
    nodes = [gpu_node(f"a10g-{i}", "NVIDIA-A10G", 4, 23028) for i in range(3)]
    discovery = discover_pools(nodes)
    spec = parse_job(job_body("e", elastic={"enabled": True, "maxGpus": 6})).spec
    cluster, _ = select_cluster(capped_spec(spec), discovery, nodes)
    assert sum(g.count for g in cluster.groups) == 6
    both = parse_job(job_body("e", maxGpus=5, elastic={"enabled": True, "maxGpus": 6})).spec
    assert capped_spec(both).max_gpus == 5  # the tighter bound wins
    off = parse_job(job_body("e", elastic={"enabled": False, "maxGpus": 6})).spec
    assert capped_spec(off) is off


def test_elastic_defaults_are_off_and_conservative() -> None:
    assert parse_job(job_body("e")).spec.elastic is None
    e = ElasticSpec()
    assert (e.enabled, e.min_gain, e.cooldown_seconds, e.max_gpus, e.restart_cost_seconds) \
        == (False, 0.1, 300, None, DEFAULT_RESTART_COST_SECONDS)


def test_the_planners_own_predictions_make_a_bigger_cluster_worth_it() -> None:
    """The figures a decision rests on, from the planner: gpt-1.3b at B=256 on 4 and on 8
    A10Gs. Eight are predicted faster by more than the 10 % minimum, and the decision
    rescales a long run but not its last steps."""
    spec = parse_job(job_body("e", model={"preset": "gpt-1.3b"}, globalBatchSize=256,
                              planner={"chooseGpus": True})).spec
    four = solve(spec, ClusterSpec(groups=[GpuGroup(product="A10G", count=4)]))
    eight = solve(spec, ClusterSpec(groups=[GpuGroup(product="A10G", count=8)]))
    assert four.predicted_samples_per_second and eight.predicted_samples_per_second
    inputs = dataclasses.replace(
        BASE, current_samples_per_second=four.predicted_samples_per_second,
        candidate_samples_per_second=eight.predicted_samples_per_second,
        global_batch_size=256, measured_samples_per_second=None, remaining_steps=100_000)
    long_run = decide(inputs)
    assert long_run.gain > 0.1 and long_run.verdict == "Rescale", long_run.reason
    assert decide(dataclasses.replace(inputs, remaining_steps=10)).code == \
        SAVING_BELOW_RESTART_COST
