"""status.plan of a hybrid plan (issue 44): the replica groups in the job's status, and a
flat plan's summary as before (no group fields)."""

from __future__ import annotations

from types import SimpleNamespace

from kube_fixtures import job_body

from cephalo.api import Plan, parse_job
from cephalo.api.status import PlanSummary
from cephalo.operator.reconcile import _summary


def _plan(groups: list[list[int]], ratio: float) -> Plan:
    return Plan.model_validate({
        "global_batch_size": 16, "world_size": 4, "predicted_samples_per_second": 10.0,
        "replica_groups": groups,
        "ranks": [{"rank": i, "gpu": "A10G", "pool": "NVIDIA-A10G", "batch_size": 4,
                   "micro_batch_size": 4, "num_micro_batches": 1, "shard_ratio": ratio}
                  for i in range(4)]})


def test_a_hybrid_plan_puts_its_groups_in_the_status_and_a_flat_one_does_not() -> None:
    ctx = SimpleNamespace(job=parse_job(job_body("gpt", checkpoint={"claimName": "c"})))
    hybrid = _summary(ctx, _plan([[0, 1], [2, 3]], 0.5))  # type: ignore[arg-type]
    assert (hybrid["replicaGroups"], hybrid["replicaGroupSize"]) == (2, 2)
    status = PlanSummary.model_validate(hybrid)  # the CRD's status model takes it
    assert (status.replica_groups, status.replica_group_size) == (2, 2)
    flat = _summary(ctx, _plan([], 0.25))  # type: ignore[arg-type]
    assert "replicaGroups" not in flat and "replicaGroupSize" not in flat
    assert "replicatedFraction" not in hybrid and "replicatedFraction" not in flat
    kept = _plan([[0, 1], [2, 3]], 0.5).model_copy(update={"replicated_fraction": 0.25})
    summary = _summary(ctx, kept)  # type: ignore[arg-type]
    assert summary["replicatedFraction"] == 0.25
    assert PlanSummary.model_validate(summary).replicated_fraction == 0.25
