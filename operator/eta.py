"""status.progress.percent and .estimatedEndTime (pure): the share of the steps done, and
when the last one will be, from the step time the current gang measured.

Kubeflow Trainer's TrainJob status carries a progress percent and an estimated time of
arrival; `kubectl get cephalojobs` shows these two as its Progress and ETA columns.

Where the step time comes from, and why an estimate is never stale: the seconds per step
are rank 0's mean over its timed steps (status.progress.timing.stepSeconds: the first step of
the process, its start-up, left out). Those sums live in rank 0's process, and each scrape
replaces status.progress whole, so a scrape of a new gang (after a gang restart, a rescale
or a re-plan) carries only that gang's timing, or none before it has timed a step; then
there is no estimate rather than the old gang's. Between gangs the phase is Restarting or
Pending, and `for_phase` drops the estimate then (no gang is training, and the restart's
own time was never in it). Not the last samples/s: a start-up or evaluation step swings it.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from cephalo.operator.status import JobPhase, now_iso

# The last instant RFC 3339 (a four-digit year) can write: an estimate past it is none.
LATEST_END_SECONDS = datetime.datetime(9999, 12, 31, 23, 59, 59,
                                       tzinfo=datetime.timezone.utc).timestamp()


def percent_done(step: int, total_steps: int) -> int:
    """Whole percent of `total_steps` done after `step`, floored (100 only once the last
    step is done), within 0..100."""
    if total_steps <= 0:
        return 100
    return max(0, min(100, step * 100 // total_steps))


def estimated_end(step: int, total_steps: int, step_seconds: float | None,
                  now_seconds: float) -> float | None:
    """When the last step ends (Unix seconds): the steps left at `step_seconds` each from
    `now_seconds`. None without a usable measured step time, or past year 9999."""
    if step_seconds is None or not math.isfinite(step_seconds) or step_seconds <= 0:
        return None
    end = now_seconds + max(0, total_steps - step) * step_seconds
    return end if end <= LATEST_END_SECONDS else None


def with_estimate(progress: dict[str, Any], now_seconds: float) -> dict[str, Any]:
    """A scrape's status.progress with `percent` and, once its gang has timed a step,
    `estimatedEndTime` (RFC 3339, UTC). A copy; without a step, `progress` as it is."""
    step, total = progress.get("step"), progress.get("totalSteps")
    if step is None or total is None:
        return progress
    out = {**progress, "percent": percent_done(int(step), int(total))}
    end = estimated_end(int(step), int(total),
                        (progress.get("timing") or {}).get("stepSeconds"), now_seconds)
    if end is not None:
        out["estimatedEndTime"] = now_iso(end)
    return out


def for_phase(progress: dict[str, Any] | None, phase: str | None) -> dict[str, Any] | None:
    """status.progress as a job in `phase` shows it: an estimated end only while Running (in
    any other phase no gang is training, and the one that measured the step time is gone or
    going); 100 percent and no end once Succeeded (also when rank 0 never reported its last
    step)."""
    if phase == JobPhase.SUCCEEDED:
        done = {k: v for k, v in (progress or {}).items() if k != "estimatedEndTime"}
        return {**done, "percent": 100}
    if phase == JobPhase.RUNNING or progress is None or "estimatedEndTime" not in progress:
        return progress
    return {k: v for k, v in progress.items() if k != "estimatedEndTime"}
