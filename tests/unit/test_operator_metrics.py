"""The operator's per-job counters have series from the moment a job is seen (issue 38).

A counter without a series until its first increment makes a dashboard panel read
"No data" instead of 0, and `increase()` in an alerting rule cannot see the first event (it
needs two samples). Read back through prometheus-client's own exposition and parser, as a
Prometheus scrape would see the page.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cephalo.operator import metrics

COUNTERS = ("cephalo_operator_gang_restarts_total", "cephalo_operator_preemptions_total",
            "cephalo_operator_replans_total", "cephalo_operator_gang_releases_total",
            "cephalo_operator_rescales_total", "cephalo_operator_rescale_skips_total",
            "cephalo_operator_rescale_rollbacks_total", "cephalo_operator_rebalances_total")


def _samples(namespace: str, job: str) -> dict[str, float]:
    page = generate_latest(REGISTRY).decode()
    return {s.name: s.value for family in text_string_to_metric_families(page)
            for s in family.samples
            if s.labels.get("cephalo_namespace") == namespace
            and s.labels.get("cephalo_job") == job}


def test_a_new_job_gets_every_counter_at_zero_and_a_gone_job_none() -> None:
    assert not _samples("ns-a", "fresh")
    metrics.set_phase("ns-a", "fresh", "Pending")
    try:
        seen = _samples("ns-a", "fresh")
        assert {name: seen.get(name) for name in COUNTERS} == dict.fromkeys(COUNTERS, 0.0)
        # An increment counts from there; a later pass does not reset it.
        metrics.RESTARTS.labels("ns-a", "fresh").inc()
        metrics.set_phase("ns-a", "fresh", "Running")
        assert _samples("ns-a", "fresh")["cephalo_operator_gang_restarts_total"] == 1.0
    finally:
        metrics.set_phase("ns-a", "fresh", None)
    assert not _samples("ns-a", "fresh"), "a deleted job's series must go"


def test_reconcile_outcomes_have_series_before_any_pass() -> None:
    page = generate_latest(REGISTRY).decode()
    outcomes = {s.labels["outcome"] for family in text_string_to_metric_families(page)
                for s in family.samples if s.name == "cephalo_operator_reconciles_total"}
    assert outcomes >= {"ok", "error"}


def test_every_per_job_counter_is_initialised() -> None:
    """A counter added to the module later must join JOB_COUNTERS too."""
    from prometheus_client import Counter

    per_job = {c._name for c in vars(metrics).values()  # prometheus-client's own attribute
               if isinstance(c, Counter) and "cephalo_job" in c._labelnames}
    assert per_job == {c._name for c in metrics.JOB_COUNTERS}
    assert {f"{name}_total" for name in per_job} == set(COUNTERS)


def test_progress_gauges_follow_status_and_go_with_their_field() -> None:
    """Issue 46 item 4: percent and the estimated end (Unix time) as status.progress has
    them; the end's series goes when the field does (a restart, Succeeded), not left stale."""
    percent, end = "cephalo_operator_progress_percent", \
        "cephalo_operator_estimated_end_timestamp_seconds"
    metrics.set_phase("ns-p", "eta", "Running")
    try:
        metrics.set_progress("ns-p", "eta", {"percent": 42,
                                             "estimatedEndTime": "2026-12-02T12:01:56Z"})
        seen = _samples("ns-p", "eta")
        assert (seen[percent], seen[end]) == (42.0, 1796212916.0)
        metrics.set_progress("ns-p", "eta", {"percent": 42})  # Restarting: no estimate
        seen = _samples("ns-p", "eta")
        assert seen[percent] == 42.0 and end not in seen
        metrics.set_progress("ns-p", "eta", None)
        assert percent not in _samples("ns-p", "eta")
        metrics.set_progress("ns-p", "eta", {"percent": 100})
    finally:
        metrics.set_phase("ns-p", "eta", None)
    assert not _samples("ns-p", "eta"), "a deleted job's series must go"


def test_the_batch_per_rank_follows_status_rebalance_and_goes_with_the_job() -> None:
    batch = "cephalo_operator_rank_batch_size"

    def ranks() -> dict[str, float]:
        page = generate_latest(REGISTRY).decode()
        return {s.labels["rank"]: s.value for family in text_string_to_metric_families(page)
                for s in family.samples if s.name == batch
                and s.labels.get("cephalo_job") == "split"}

    metrics.set_phase("ns-s", "split", "Running")
    metrics.set_split("ns-s", "split", {"batchSizes": [20, 10, 2]})
    assert ranks() == {"0": 20.0, "1": 10.0, "2": 2.0}
    metrics.set_split("ns-s", "split", {"batchSizes": [24, 8]})  # a smaller gang
    assert ranks() == {"0": 24.0, "1": 8.0}
    metrics.set_phase("ns-s", "split", None)
    assert ranks() == {}


def test_each_ranks_replica_group_follows_the_adopted_plan_and_goes_with_the_job() -> None:
    """Issue 44: the dashboard's groups panel reads which group each rank is in."""
    def groups() -> dict[str, float]:
        page = generate_latest(REGISTRY).decode()
        return {s.labels["rank"]: s.value for family in text_string_to_metric_families(page)
                for s in family.samples if s.name == "cephalo_operator_rank_replica_group"
                and s.labels.get("cephalo_job") == "hy"}

    metrics.set_phase("ns-h", "hy", "Pending")
    metrics.set_replica_groups("ns-h", "hy", [[0, 1], [2, 3]], 4)
    assert groups() == {"0": 0.0, "1": 0.0, "2": 1.0, "3": 1.0}
    metrics.set_replica_groups("ns-h", "hy", [], 3)  # re-planned flat on fewer GPUs
    assert groups() == {"0": 0.0, "1": 0.0, "2": 0.0}
    metrics.set_phase("ns-h", "hy", None)
    assert groups() == {}
