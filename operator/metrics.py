"""Operator metrics (prometheus-client, default registry: process memory/CPU come for free).

Per-job series carry `cephalo_namespace` and `cephalo_job`, the same two labels the chart's
PodMonitor puts on every trainer series, so one dashboard query joins both. Not `job` and
`namespace`: Prometheus sets those on every target (the scrape job, the operator's own
namespace), and with the default honor_labels: false it renames a clashing scraped label to
`exported_job`; honoring it instead would silently replace the target's own labels.
Counters end in `_total` and are read with rate()/increase().
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from cephalo.api.job import Phase
from cephalo.operator.status import parse_time

PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]
JOB_LABELS = ("cephalo_namespace", "cephalo_job")  # .labels(namespace, name), in this order

JOBS = Gauge("cephalo_operator_jobs", "CephaloJobs this operator tracks, by phase", ["phase"])
RECONCILES = Counter("cephalo_operator_reconciles_total",
                     "Reconcile passes by outcome (ok, error)", ["outcome"])
RECONCILE_SECONDS = Histogram("cephalo_operator_reconcile_duration_seconds",
                              "Wall time of one reconcile pass")
PLANNING_SECONDS = Histogram("cephalo_operator_planning_duration_seconds",
                             "Wall time of cephalo.planner.solve per job",
                             buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PROFILING_SECONDS = Histogram("cephalo_operator_profiling_duration_seconds",
                              "Profiler pod creation to result, per GPU product", ["product"],
                              buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200))
PREDICTED_SAMPLES = Gauge("cephalo_operator_predicted_samples_per_second",
                          "The plan's predicted throughput", JOB_LABELS)
MEASURED_SAMPLES = Gauge("cephalo_operator_measured_samples_per_second",
                         "Throughput rank 0 reports", JOB_LABELS)
# status.progress.percent and .estimatedEndTime (cephalo.operator.eta); the end is a Unix
# timestamp, so `(x - time())` is the time left, and has no series while there is none.
PROGRESS_PERCENT = Gauge("cephalo_operator_progress_percent",
                         "Share of the training steps done, in percent (100 once Succeeded)",
                         JOB_LABELS)
ESTIMATED_END = Gauge("cephalo_operator_estimated_end_timestamp_seconds",
                      "When the last training step is estimated to end (Unix time), from the "
                      "running gang's measured step time; no series when not Running or "
                      "before that gang has timed a step", JOB_LABELS)
RESTARTS = Counter("cephalo_operator_gang_restarts_total", "Gang restarts", JOB_LABELS)
PREEMPTIONS = Counter("cephalo_operator_preemptions_total",
                      "Gang restarts after a disruption (preemption, eviction, drain); not "
                      "counted toward backoffLimit", JOB_LABELS)
REPLANS = Counter("cephalo_operator_replans_total", "Re-plans (spec change, GPUs lost)",
                  JOB_LABELS)
GANG_RELEASES = Counter("cephalo_operator_gang_releases_total",
                        "Gangs released because ranks stayed unschedulable past "
                        "schedulingPolicy.scheduleTimeoutSeconds (re-planned on free GPUs; "
                        "not counted toward backoffLimit)", JOB_LABELS)
# Wake-ups of jobs waiting for GPUs because a Cephalo job or pod let GPUs go (instead of
# waiting for their next periodic re-check).
GPU_WAKEUPS = Counter("cephalo_operator_freed_gpu_wakeups_total",
                      "Rounds of waking jobs that wait for GPUs after GPUs were freed")
# spec.elastic (issue 28): rescales onto more GPUs, and the decisions not to.
RESCALES = Counter("cephalo_operator_rescales_total",
                   "Rescales of a running job onto GPUs that became free (spec.elastic; not "
                   "counted as gang restarts, failures or preemptions)", JOB_LABELS)
RESCALE_SKIPS = Counter("cephalo_operator_rescale_skips_total",
                        "Offers of more GPUs an elastic job declined (gain below minGain, "
                        "saving below the restart cost, cooldown, …)", JOB_LABELS)
RESCALE_ROLLBACKS = Counter("cephalo_operator_rescale_rollbacks_total",
                            "Rescales rolled back to the GPUs the job had: the grown gang was "
                            "not scheduled within spec.elastic.rescaleTimeoutSeconds (a gang "
                            "scheduler's quota refused it)", JOB_LABELS)
# Live rebalancing (spec.planner.rebalance): the split in force per rank (status.rebalance)
# and its changes without a restart.
RANK_BATCH = Gauge("cephalo_operator_rank_batch_size",
                   "Samples each rank takes of the global batch under the split in force "
                   "(live rebalancing moves them without a restart)", (*JOB_LABELS, "rank"))
# Hybrid sharding (docs/hybrid-sharding.md): which replica group each rank of the plan in
# force belongs to, so a panel shows the groups beside the per-rank series.
RANK_REPLICA_GROUP = Gauge("cephalo_operator_rank_replica_group",
                           "Replica group of each rank under the plan in force (hybrid "
                           "sharding: groups 0..G-1, each holding the weights sharded among "
                           "its ranks; "
                           "flat sharding: every rank in group 0)", (*JOB_LABELS, "rank"))
REBALANCES = Counter("cephalo_operator_rebalances_total",
                     "Changes of a running job's split of the global batch by live "
                     "rebalancing (no restart)", JOB_LABELS)
# Leader election (cephalo.operator.leader): 1 on the replica whose handlers run, 0 on a
# standby; sum() over the replicas is 1 while the operator works.
LEADER = Gauge("cephalo_operator_leader",
               "1 when this operator replica holds the leader Lease and runs the handlers")
# Per-job counters start at 0 when the operator first sees a job (set_phase): a counter
# with no series until its first increment reads "No data" on a panel and makes
# increase()/rate() in alerting rules blind to the first event.
JOB_COUNTERS = (RESTARTS, PREEMPTIONS, REPLANS, GANG_RELEASES, RESCALES, RESCALE_SKIPS,
                RESCALE_ROLLBACKS, REBALANCES)
PER_JOB = (PREDICTED_SAMPLES, MEASURED_SAMPLES, PROGRESS_PERCENT, ESTIMATED_END, *JOB_COUNTERS)
RECONCILE_OUTCOMES = ("ok", "error")
for _outcome in RECONCILE_OUTCOMES:  # both from the start: an error rate reads 0, not nothing
    RECONCILES.labels(_outcome)

_phases: dict[tuple[str, str], str] = {}
# Per-rank series per job (RANK_BATCH, RANK_REPLICA_GROUP), to remove them all.
_ranks: dict[tuple[Gauge, str, str], int] = {}


def set_phase(namespace: str, job: str, phase: str | None) -> None:
    """Track a job's phase (None: the job is gone) and refresh the per-phase gauge."""
    if phase is None:
        _phases.pop((namespace, job), None)
        for metric in PER_JOB:  # a deleted job's series go too: no unbounded growth
            with contextlib.suppress(KeyError):
                metric.remove(namespace, job)
        set_split(namespace, job, None)
        set_replica_groups(namespace, job, [], 0)
    else:
        if (namespace, job) not in _phases:
            for counter in JOB_COUNTERS:
                counter.labels(namespace, job)  # creates the series at 0
        _phases[(namespace, job)] = phase
    for p in PHASES:
        JOBS.labels(p).set(sum(1 for v in _phases.values() if v == p))


def set_progress(namespace: str, job: str, progress: dict[str, Any] | None) -> None:
    """The progress gauges from status.progress as written; a series goes with its field."""
    progress = progress or {}
    for gauge, value in ((PROGRESS_PERCENT, progress.get("percent")),
                         (ESTIMATED_END, parse_time(progress.get("estimatedEndTime")))):
        if value is None:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, job)
        else:
            gauge.labels(namespace, job).set(value)


def set_split(namespace: str, job: str, rebalance: dict[str, Any] | None) -> None:
    """The per-rank batch series from status.rebalance as written (none without it)."""
    _set_per_rank(RANK_BATCH, namespace, job, (rebalance or {}).get("batchSizes") or [])


def set_replica_groups(namespace: str, job: str, groups: list[list[int]],
                       world_size: int) -> None:
    """Each rank's replica group under the plan just adopted (`groups` empty: flat, every
    rank in group 0; `world_size` 0: the job is gone, its series too)."""
    group_of = [0] * world_size
    for index, group in enumerate(groups):
        for rank in group:
            group_of[rank] = index
    _set_per_rank(RANK_REPLICA_GROUP, namespace, job, group_of)


def _set_per_rank(gauge: Gauge, namespace: str, job: str, values: list[int]) -> None:
    """One series per rank of `values`; the ranks a smaller gang no longer has go."""
    key = (gauge, namespace, job)
    for rank in range(len(values), _ranks.get(key, 0)):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, job, str(rank))
    for rank, value in enumerate(values):
        gauge.labels(namespace, job, str(rank)).set(value)
    if values:
        _ranks[key] = len(values)
    else:
        _ranks.pop(key, None)


def serve(port: int) -> None:
    if port > 0:
        start_http_server(port)
