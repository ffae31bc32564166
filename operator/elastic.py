"""Elastic scaling decisions (pure): rescale a running job onto more GPUs, or not, and why.

The operator (cephalo.operator.rescale) gathers the inputs — the GPUs the job could use
now, the candidate plan the planner made on them, the job's progress and its measured
restarts — and this module decides. A rescale happens only when all of these hold:

* the candidate plan is predicted to give at least `minGain` more throughput than the
  current plan (both predictions come from the same profiles and cost model, so their ratio
  is what the model resolves best);
* the seconds it saves over the remaining steps exceed the restart's cost. The saving is
  the *measured* step time (rank 0's samples/s, else the prediction) times the predicted
  ratio, so it is in real seconds like the restart cost it is weighed against: this job's
  own measured restarts (the largest of the last few: restarts vary), else
  spec.elastic.restartCostSeconds;
* `cooldownSeconds` passed since the last rescale (a flapping node, or GPUs that come and
  go, cause one rescale and not a storm).

A verdict that time cannot change (gain too small; the saving only shrinks as steps are
done) is final for the offer it was made on: the same offer is not planned again. A
cooldown is not final: the offer is looked at again when it ends (`retry_at`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from cephalo.api.elastic import DEFAULT_RESTART_COST_SECONDS, KEPT_RESTART_MEASUREMENTS
from cephalo.api.job import CephaloJobSpec

Verdict = Literal["Rescale", "Skip"]
RESCALE = "Rescale"
GAIN_BELOW_MINIMUM = "GainBelowMinimum"
SAVING_BELOW_RESTART_COST = "SavingBelowRestartCost"
COOLDOWN = "Cooldown"


@dataclass(frozen=True)
class RescaleInputs:
    now: float  # the operator's clock, seconds
    current_gpus: int
    candidate_gpus: int
    current_samples_per_second: float  # predicted, current plan
    candidate_samples_per_second: float  # predicted, the plan on the GPUs it could use
    measured_samples_per_second: float | None  # rank 0's, under the current plan
    global_batch_size: int
    remaining_steps: int
    restart_cost_seconds: float
    restart_cost_measured: bool
    min_gain: float
    cooldown_seconds: float
    last_rescale_at: float | None  # operator clock; None: never rescaled


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    code: str  # RESCALE or why not
    reason: str  # one sentence with the figures
    gain: float  # candidate / current predicted throughput - 1
    saved_seconds: float  # predicted, over the remaining steps
    retry_at: float | None = None  # not final: look at the same offer again then


def decide(i: RescaleInputs) -> Decision:
    current = max(i.current_samples_per_second, 1e-12)
    gain = i.candidate_samples_per_second / current - 1.0
    rate = i.measured_samples_per_second or current
    step_seconds = i.global_batch_size / max(rate, 1e-12)
    # step time now x (1 - new step time / old step time), the ratio as predicted
    saved = max(0.0, i.remaining_steps * step_seconds * (1.0 - current / max(
        i.candidate_samples_per_second, 1e-12)))
    gpus = f"{i.current_gpus} -> {i.candidate_gpus} GPUs"
    figures = (f"predicted {i.current_samples_per_second:.1f} -> "
               f"{i.candidate_samples_per_second:.1f} samples/s ({gain:+.0%})")
    cost = (f"restart cost {i.restart_cost_seconds:.1f} s "
            f"({'measured' if i.restart_cost_measured else 'assumed'})")
    if gain < i.min_gain:
        return Decision("Skip", GAIN_BELOW_MINIMUM,
                        f"{gpus}: {figures}, below the minimum gain {i.min_gain:.0%}", gain, saved)
    if saved <= i.restart_cost_seconds:
        return Decision("Skip", SAVING_BELOW_RESTART_COST,
                        f"{gpus}: {figures} would save {saved:.1f} s over the "
                        f"{i.remaining_steps} remaining steps, not more than the {cost}",
                        gain, saved)
    if i.last_rescale_at is not None and i.now < i.last_rescale_at + i.cooldown_seconds:
        until = i.last_rescale_at + i.cooldown_seconds
        return Decision("Skip", COOLDOWN,
                        f"{gpus}: {figures}, saving {saved:.1f} s, but the last rescale was "
                        f"{i.now - i.last_rescale_at:.0f} s ago (cooldown "
                        f"{i.cooldown_seconds:g} s)", gain, saved, retry_at=until)
    return Decision("Rescale", RESCALE,
                    f"{gpus}: {figures}, saving {saved:.1f} s over the {i.remaining_steps} "
                    f"remaining steps, more than the {cost}", gain, saved)


def restart_cost(measured: Sequence[float] | None,
                 assumed: float = DEFAULT_RESTART_COST_SECONDS) -> tuple[float, bool]:
    """(seconds, measured?): the largest of this job's measured restarts, else `assumed`."""
    if measured:
        return max(measured), True
    return assumed, False


def record_restart(measured: Sequence[float] | None, seconds: float) -> list[float]:
    """The measurements with `seconds` added (newest last, the last few kept)."""
    return [*(measured or []), round(seconds, 3)][-KEPT_RESTART_MEASUREMENTS:]


def offers_more(current: Mapping[str, int], offer: Mapping[str, int]) -> bool:
    """Some pool offers more GPUs than the plan uses there: worth planning on."""
    return any(n > current.get(pool, 0) for pool, n in offer.items())


def should_evaluate(offer: Mapping[str, int], last_offer: Mapping[str, int] | None,
                    last_verdict: str | None, retry_at: float | None, now: float) -> bool:
    """Plan on `offer` unless the last decision was a skip on the same offer that is final,
    or whose cooldown has not ended yet (after a rescale the job's plan changed: any offer
    is new to it)."""
    if last_offer is None or last_verdict != "Skip" or dict(offer) != dict(last_offer):
        return True
    return retry_at is not None and now >= retry_at


def announce(previous: tuple[str | None, str | None], decision: Decision) -> bool:
    """Post an Event for this decision? Every rescale; a skip only when the verdict or its
    reason changed (a flapping node must not post an Event per flap)."""
    return decision.verdict == "Rescale" or previous != (decision.verdict, decision.code)




def capped_spec(spec: CephaloJobSpec) -> CephaloJobSpec:
    """The spec as planned with elastic on: spec.maxGpus lowered to elastic.maxGpus (the job
    never plans on more, whether it grows or re-plans for another reason)."""
    elastic = spec.elastic
    if elastic is None or not elastic.enabled or elastic.max_gpus is None:
        return spec
    cap = elastic.max_gpus if spec.max_gpus is None else min(spec.max_gpus, elastic.max_gpus)
    return spec.model_copy(update={"max_gpus": cap})


__all__ = ["Decision", "RescaleInputs", "announce", "capped_spec", "decide", "offers_more",
           "record_restart", "restart_cost", "should_evaluate"]
