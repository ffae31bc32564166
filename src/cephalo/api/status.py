"""The CephaloJob status: written by the operator, read by kubectl, the chart and tests."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from cephalo.api.elastic import ElasticStatus
from cephalo.api.replan import MAX_TIMED_RANKS, ReplanStatus, StepTiming
from cephalo.api.wire import CamelModel, StatusModel

Phase = Literal["Pending", "Profiling", "Planning", "Running", "Restarting", "Suspended",
                "Succeeded", "Failed"]


class Condition(StatusModel):
    """One observed aspect of the job (Kubernetes API conventions), keyed by `type`."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None


class PlanSummary(StatusModel):
    """The current plan in brief; the full plan JSON is in `configMap`."""

    world_size: int | None = Field(default=None, description="Ranks (GPUs) in the plan.")
    predicted_samples_per_second: float | None = Field(
        default=None, description="Throughput the planner predicts.")
    speedup_over_even_fsdp: float | None = Field(
        default=None, alias="speedupOverEvenFSDP",
        description="Predicted throughput over even FSDP on the same GPUs.")
    config_map: str | None = Field(default=None,
                                   description="ConfigMap holding the full plan JSON.")
    pools: dict[str, int] | None = Field(default=None, description="GPUs used per pool.")
    network_source: str | None = Field(default=None, max_length=256, description=(
        "Where the network the plan priced its collectives over came from: measured (the "
        "operator's network probe), the job spec, node labels, or assumed (a default)."))
    network_gbps: float | None = Field(default=None, description=(
        "Per-GPU bandwidth of the plan's collectives (the slowest link its ring crosses), "
        "Gbit/s."))
    # Hybrid sharding (docs/hybrid-sharding.md); omitted for a flat plan.
    replica_groups: int | None = Field(default=None, description=(
        "Hybrid sharding: how many replica groups the ranks form, each holding the weights "
        "sharded among its ranks, the optimizer state split across the groups (omitted: "
        "flat, one group)."))
    replica_group_size: int | None = Field(default=None, description=(
        "Hybrid sharding: ranks per replica group."))
    replicated_fraction: float | None = Field(default=None, ge=0.0, le=1.0, description=(
        "Hybrid sharding: the share of every rank's slice whose whole optimizer state each "
        "replica group keeps, its gradient all-reduced across groups (omitted: none)."))


class Progress(StatusModel):
    """Training progress as last reported by rank 0."""

    step: int | None = Field(default=None, description="Last completed optimizer step.")
    total_steps: int | None = None
    loss: float | None = Field(default=None, description="Mean loss of the last step.")
    validation_loss: float | None = Field(default=None, description=(
        "Mean loss on the held-out validation set at the last evaluation "
        "(spec.training.evalIntervalSteps)."))
    samples_per_second: float | None = Field(default=None,
                                             description="Measured training throughput.")
    timing: StepTiming | None = Field(default=None, description=(
        "Means over the gang's timed steps: step time and every rank's compute / waiting "
        "split (what re-planning calibrates from)."))
    percent: int | None = Field(default=None, ge=0, le=100, description=(
        "Share of the training steps done, in whole percent (floored: 100 once Succeeded)."))
    estimated_end_time: str | None = Field(default=None, max_length=64, description=(
        "When the last step is estimated to end (RFC 3339, UTC): the steps left at the "
        "running gang's measured step time (timing.stepSeconds). Absent until that gang has "
        "timed a step, after a gang restart or re-plan until the new gang has, and whenever "
        "the job is not Running."))
    last_update_time: str | None = None


class RebalanceStatus(StatusModel):
    """Live rebalancing (spec.planner.rebalance; docs/rebalancing.md): the split of the
    global batch in force, as rank 0's /metrics shows it, and its changes. Each change
    also posts an Event `Rebalanced`."""

    batch_sizes: list[int] | None = Field(default=None, max_length=MAX_TIMED_RANKS,
                                          description=(
                                              "The split in force: samples each rank takes "
                                              "of the global batch, by rank."))
    micro_batches: list[int] | None = Field(default=None, max_length=MAX_TIMED_RANKS,
                                            description=(
                                                "Each rank's microbatches per step under the "
                                                "split in force (its microbatch size is the "
                                                "plan's)."))
    changes: int | None = Field(default=None, ge=0, description=(
        "Changes of the split without a restart, over the job's life."))
    last_change_step: int | None = Field(default=None, ge=0, description=(
        "The step after which the split last changed."))
    last_change_time: str | None = Field(default=None, max_length=64, description=(
        "When the operator saw that change (RFC 3339)."))
    last_change_reason: str | None = Field(default=None, max_length=1024, description=(
        "Why: the old and new split and the predicted gain, as the trainer decided it."))
    held_step: int | None = Field(default=None, ge=0, description=(
        "Present while memory keeps the split short of the one the ranks' speeds want: "
        "the step of the decision that found it."))
    held_reason: str | None = Field(default=None, max_length=1024, description=(
        "Why the split stays short: which rank would need how many samples and how many its "
        "memory holds at its microbatch size (more needs a restart: re-planning)."))
    gang_pod: str | None = Field(default=None, max_length=128, description=(
        "The uid of the rank-0 pod whose changes gangChanges counts (a new gang counts "
        "from 0)."))
    gang_changes: int | None = Field(default=None, ge=0, description=(
        "Changes made by that gang, as its rank 0 counts them."))


class FinalSplit(CamelModel):
    """The split in force as rank 0 leaves it (FinalProgress.rebalance): the figures its
    /metrics page shows (cephalo.trainer.metrics.TrainerMetrics.show_split), so that a
    change in the last steps, after the operator's last scrape, is still counted."""

    model_config = ConfigDict(extra="ignore")

    batch_sizes: list[int] = Field(max_length=MAX_TIMED_RANKS)
    micro_batches: list[int] = Field(max_length=MAX_TIMED_RANKS)
    changes: int = Field(default=0, ge=0, le=2**53)
    last_change_step: int | None = Field(default=None, ge=0, le=2**63 - 1)
    last_change_reason: str | None = Field(default=None, max_length=1024)


class FinalProgress(CamelModel):
    """What rank 0 leaves as its termination message when it completes (written to
    CEPHALO_TERMINATION_LOG, the container's terminationMessagePath): its last step, that
    step's loss, the last measured throughput and validation loss. The operator copies it
    into status.progress when the job succeeds: a scrape of /metrics may have seen an earlier
    step or none. It comes from the user's image, so it is checked (finite, in range) and
    unknown keys are ignored (a newer trainer may say more)."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(ge=0, le=2**63 - 1)
    loss: float | None = None
    samples_per_second: float | None = Field(default=None, ge=0)
    validation_loss: float | None = None
    rebalance: FinalSplit | None = None


class CephaloJobStatus(StatusModel):
    model_config = ConfigDict(extra="allow")  # kopf keeps its own bookkeeping in status

    phase: Phase | None = None
    message: str | None = None
    conditions: list[Condition] | None = None
    observed_generation: int | None = None
    plan: PlanSummary | None = None
    progress: Progress | None = None
    restarts: int | None = Field(default=None, description=(
        "Gang restarts counted toward backoffLimit (a rank failed or was deleted)."))
    preemptions: int | None = Field(default=None, description=(
        "Gang restarts after a disruption (preemption, eviction, drain); not counted toward "
        "backoffLimit."))
    launched_attempt: str | None = Field(default=None, description=(
        "<attempt>/<config hash> once every rank pod of that attempt existed: a rank pod "
        "missing after that vanished, one missing before it is still to be created."))
    elastic: ElasticStatus | None = Field(default=None, description=(
        "Elastic scaling (spec.elastic): rescales and the last decision."))
    replan: ReplanStatus | None = Field(default=None, description=(
        "Re-planning from measurements (spec.planner.replan): the last calibration."))
    rebalance: RebalanceStatus | None = Field(default=None, description=(
        "Live rebalancing (spec.planner.rebalance): the split in force and its changes."))
    start_time: str | None = None
    completion_time: str | None = None
