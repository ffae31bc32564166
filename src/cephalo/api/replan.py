"""spec.planner.replan and status.replan of a CephaloJob: re-planning a running job from
what it measured (issue 35, item 3; docs/replanning.md).

On by default. Once a plan's gang has logged `afterSteps` timed steps, the operator
recalibrates the cost model from the measured step time and every rank's compute / waiting
split (cephalo.planner.feedback.recalibrate), solves again on the GPUs the job holds, and re-plans
through the rescale path when the new plan is predicted at least `minGain` faster and the
seconds it saves over the remaining steps exceed the restart cost. One calibration per plan;
a re-plan whose measured gain falls short of `minGain` stops re-planning for the job, and
`maxReplans` bounds them all.
"""

from __future__ import annotations

from pydantic import Field

from cephalo.api.elastic import DEFAULT_RESTART_COST_SECONDS
from cephalo.api.wire import CamelModel, StatusModel

# A running job whose measured throughput is below this fraction of its plan's prediction
# is reported (condition PredictionOff) when no re-plan fixes it.
PREDICTION_OFF_BELOW = 0.5
MAX_TIMED_RANKS = 256  # the trainer exports every rank's split up to this many ranks


class ReplanSpec(CamelModel):
    """Re-plan a running job once its measured steps show the model was off."""

    enabled: bool = Field(default=True, description=(
        "Recalibrate the cost model from the running job's measured steps and re-plan on "
        "the GPUs it holds when that pays for the restart (false: never)."))
    min_gain: float = Field(default=0.1, ge=0, le=100, description=(
        "Re-plan only when the recalibrated plan is predicted to give at least this "
        "fraction more throughput than the current plan under the same calibration "
        "(0.1: 10 %)."))
    after_steps: int = Field(default=5, ge=1, le=1_000_000, description=(
        "Timed steps (the gang's first step left out) a plan runs before it is "
        "recalibrated; once per plan."))
    restart_cost_seconds: float = Field(
        default=DEFAULT_RESTART_COST_SECONDS, ge=0, le=86_400, description=(
            "What a re-plan's restart is assumed to cost until this job measured one (then "
            "the largest of its measured restarts counts, as for spec.elastic)."))
    max_replans: int = Field(default=3, ge=0, le=1000, description=(
        "Re-plans from measurements a job makes at most (0: calibrate and report, never "
        "re-plan). Re-planning also stops at the first re-plan whose measured gain falls "
        "short of minGain."))


class StepTiming(StatusModel):
    """Means over a gang's timed steps, from rank 0's /metrics."""

    steps: int | None = Field(default=None, description="Timed steps (the first left out).")
    step_seconds: float | None = Field(default=None, description="Mean step wall time.")
    compute_seconds: list[float] | None = Field(default=None, max_length=MAX_TIMED_RANKS,
                                                description="Per rank: mean compute seconds.")
    wait_seconds: list[float] | None = Field(default=None, max_length=MAX_TIMED_RANKS,
                                             description=(
                                                 "Per rank: mean seconds waited on "
                                                 "collectives."))


class Calibration(StatusModel):
    """The last recalibration: what was measured, what the plan predicted, what changed."""

    time: str | None = None
    plan_hash: str | None = Field(default=None, description=(
        "The plan calibrated (its config hash): once per plan."))
    step: int | None = None
    measured_step_seconds: float | None = None
    predicted_step_seconds: float | None = Field(default=None, description=(
        "The current plan's prediction by the model it was planned with."))
    calibrated_step_seconds: float | None = Field(default=None, description=(
        "The current plan under the recalibrated model (close to the measured one when "
        "the model explains it)."))
    candidate_step_seconds: float | None = Field(default=None, description=(
        "The recalibrated plan on the same GPUs: predicted step."))
    current_gpus: int | None = None
    candidate_gpus: int | None = None
    batch_sizes: list[int] | None = Field(default=None, max_length=MAX_TIMED_RANKS,
                                          description=(
                                              "The split of the global batch the measured "
                                              "steps ran under, when live rebalancing had "
                                              "moved it from the plan's (the calibration "
                                              "prices that split)."))
    compute_scale: dict[str, float] | None = Field(default=None, description=(
        "Per GPU type: measured compute / profiled compute."))
    collective_scale: float | None = Field(default=None, description=(
        "Measured collective time / the model's (bandwidth divided and latency multiplied "
        "by it)."))
    network_bandwidth_gbps: float | None = Field(default=None, description=(
        "The effective network bandwidth the calibration found (Gbit/s per GPU)."))
    network_latency_microseconds: float | None = None
    explained: bool | None = Field(default=None, description=(
        "The recalibrated model reproduces the measured step (within 10 %)."))
    measured_gain: float | None = Field(default=None, description=(
        "The first calibration after a re-plan: the throughput measured now over the one "
        "measured before the re-plan, minus 1 (what the re-plan delivered)."))
    verdict: str | None = Field(default=None, description="Replan or Keep.")
    reason_code: str | None = None
    reason: str | None = Field(default=None, description="Why, in one sentence.")


class ReplanStatus(StatusModel):
    """What re-planning from measurements did."""

    replans: int | None = Field(default=None, description=(
        "Re-plans from a recalibration (each also counted in status.elastic.rescales)."))
    last_calibration: Calibration | None = Field(default=None, description=(
        "The last calibration (of the current plan, once its gang has timed steps)."))
    last_replan: Calibration | None = Field(default=None, description=(
        "The calibration that caused the last re-plan."))
    stopped: str | None = Field(default=None, description=(
        "Why this job re-plans no more (a re-plan measured short of its gain); unset while "
        "it may."))
