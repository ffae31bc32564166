"""spec.elastic and status.elastic of a CephaloJob: growing (and rebalancing) a running job
onto GPUs that became free (issue 28).

Off by default. When on, the operator re-plans a Running job on the GPUs it could use now
(its own plus the free ones, at most `maxGpus`) whenever that is more than its plan uses,
and rescales (drain at a step boundary, checkpoint, resume under the new plan) only when
the predicted saving over the remaining steps exceeds the restart's cost, the predicted
throughput gain is at least `minGain`, and `cooldownSeconds` passed since the last rescale.
The decision and its figures are in status.elastic.lastDecision (`cephalo status NAME`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cephalo.api.wire import CamelModel, StatusModel

# Assumed before this job's own rescales measured a restart: a checkpoint, new pods
# scheduled, images and torch started, the checkpoint loaded. Two minutes is on the
# conservative side of what a restart takes on a real cluster with a warm image cache.
DEFAULT_RESTART_COST_SECONDS = 120.0
# Measured restarts kept in status (the newest last); the estimate is their maximum.
KEPT_RESTART_MEASUREMENTS = 5


class ElasticSpec(CamelModel):
    """Scale a running job up (and rebalance it) when usable GPUs appear."""

    enabled: bool = Field(default=False, description=(
        "Grow the running job onto GPUs that become free (a reservation released, nodes "
        "added or Ready again, taints lifted) when that pays for the restart."))
    min_gain: float = Field(default=0.1, ge=0, le=100, description=(
        "Rescale only when the new plan is predicted to give at least this fraction more "
        "throughput (0.1: 10 %)."))
    cooldown_seconds: int = Field(default=300, ge=0, le=604_800, description=(
        "Seconds after a rescale before the next one (a flapping node causes one rescale, "
        "not a storm); at most a week."))
    max_gpus: int | None = Field(default=None, ge=1, le=100_000, description=(
        "With elastic on, never plan on more GPUs than this (unset: no bound beyond "
        "spec.maxGpus and the pools' maxGpus)."))
    rescale_timeout_seconds: int = Field(default=300, ge=1, le=86_400, description=(
        "A rescale whose new rank pods are not all scheduled (admitted by Kueue or Volcano, "
        "placed by the scheduler) this many seconds after they were created goes back to "
        "the GPUs the job had: a gang scheduler's quota may refuse what the nodes offer."))
    restart_cost_seconds: float = Field(
        default=DEFAULT_RESTART_COST_SECONDS, ge=0, le=86_400, description=(
            "What a restart (drain, checkpoint, reschedule, load) is assumed to cost until "
            "this job's own rescales measured it (then the largest of the last measurements "
            "counts)."))


Verdict = Literal["Rescale", "Skip"]


class RescaleDecision(StatusModel):
    """The operator's last rescale decision and the figures it rests on."""

    time: str | None = Field(default=None, description="When it was decided.")
    verdict: Verdict | None = None
    reason: str | None = Field(default=None, description="Why, in one sentence.")
    reason_code: str | None = Field(default=None, description=(
        "Rescale, GainBelowMinimum, SavingBelowRestartCost, Cooldown, NotDurable, "
        "PlanningFailed, NoProgress, NotAdmitted (a rescale rolled back), Profiling (a "
        "pool freed since the job planned is profiled before deciding), ProfilingFailed."))
    free_gpus: dict[str, int] | None = Field(default=None, description=(
        "GPUs per pool the job could use then (its own and the free ones)."))
    current_gpus: int | None = None
    candidate_gpus: int | None = None
    current_samples_per_second: float | None = Field(default=None, description=(
        "The current plan's predicted throughput."))
    candidate_samples_per_second: float | None = Field(default=None, description=(
        "The plan on the GPUs it could use: predicted throughput."))
    measured_samples_per_second: float | None = None
    gain: float | None = Field(default=None, description=(
        "Predicted throughput gain of the candidate plan (0.9: 90 % more)."))
    remaining_steps: int | None = None
    saved_seconds: float | None = Field(default=None, description=(
        "Predicted seconds saved over the remaining steps."))
    restart_cost_seconds: float | None = None
    restart_cost_source: Literal["measured", "default"] | None = None
    retry_time: str | None = Field(default=None, description=(
        "When the same offer is looked at again (after a cooldown)."))


class PoolProfileFailure(StatusModel):
    """A pool whose profiling for elastic growth failed every attempt: left out until
    retryTime."""

    failures: int | None = Field(default=None, description="Times in a row it failed.")
    time: str | None = Field(default=None, description="When it last failed.")
    retry_time: str | None = Field(default=None, description=(
        "When the pool is profiled again (cooldownSeconds, doubled with each failure, at "
        "most a day)."))
    reason: str | None = Field(default=None, description="The last failure.")


class ElasticStatus(StatusModel):
    """What elastic scaling did: rescales, the last decision, measured restart costs."""

    rescales: int | None = Field(default=None, description=(
        "Rescales so far (not counted as restarts, failures or preemptions)."))
    rollbacks: int | None = Field(default=None, description=(
        "Rescales rolled back: the grown gang was not scheduled within "
        "rescaleTimeoutSeconds, and the job went back to the GPUs it had."))
    last_rescale_time: str | None = None
    last_decision: RescaleDecision | None = None
    profile_failures: dict[str, PoolProfileFailure] | None = Field(default=None, description=(
        "Pools (by product) whose profiling before a growth failed: left out of elastic "
        "offers until their retryTime; the job trains on."))
    restart_seconds: list[float] | None = Field(default=None, max_length=16, description=(
        "Measured seconds from a rescale's drain to the first step of the new plan "
        "(newest last)."))
    rescale_started_time: str | None = Field(default=None, description=(
        "A rescale in progress: when its drain started (cleared at its first step)."))
    rescale_from_step: int | None = Field(default=None, description=(
        "A rescale in progress: the last step reported before the drain."))
    rescale_from_gpus: dict[str, int] | None = Field(default=None, description=(
        "A rescale in progress: GPUs per pool of the plan before it (a rollback's target)."))
    rescale_launched_time: str | None = Field(default=None, description=(
        "A rescale in progress: when every rank pod of the new plan existed (the "
        "rescaleTimeoutSeconds clock starts)."))
