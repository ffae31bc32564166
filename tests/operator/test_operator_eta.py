"""status.progress.percent and .estimatedEndTime (issue 46 item 4), the pure half:
cephalo.operator.eta. The operator's emulator test is in test_operator_e2e.py
(test_progress_percent_and_eta_follow_the_current_gang)."""

from __future__ import annotations

import datetime
import math
import re

import pytest

from cephalo.operator.eta import estimated_end, for_phase, percent_done, with_estimate

NOW = datetime.datetime(2026, 12, 2, 12, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@pytest.mark.parametrize(("step", "total", "percent"), [
    (0, 100, 0), (42, 100, 42), (1, 3, 33), (2, 3, 66),
    (999, 1000, 99),  # floored: 100 only once the last step is done
    (1000, 1000, 100), (1200, 1000, 100),  # a step past the total (steps lowered) is done
])
def test_percent_is_the_share_of_steps_done_floored(step: int, total: int, percent: int) -> None:
    assert percent_done(step, total) == percent


def test_the_end_is_now_plus_the_steps_left_at_the_measured_step_time() -> None:
    assert estimated_end(42, 100, 2.0, NOW) == NOW + 58 * 2.0
    assert estimated_end(100, 100, 2.0, NOW) == NOW  # nothing left
    assert estimated_end(120, 100, 2.0, NOW) == NOW  # never in the past


@pytest.mark.parametrize("step_seconds", [None, 0.0, -1.0, math.nan, math.inf])
def test_no_end_without_a_measured_step_time(step_seconds: float | None) -> None:
    assert estimated_end(42, 100, step_seconds, NOW) is None


def test_no_end_past_what_rfc_3339_can_write() -> None:
    # A hung rank's step time (a day) times 2**40 steps is past year 9999.
    assert estimated_end(0, 2**40, 86400.0, NOW) is None


def test_a_scrape_gets_percent_and_an_rfc_3339_end_from_its_own_step_time() -> None:
    scraped = {"step": 42, "totalSteps": 100, "loss": 2.5,
               "timing": {"steps": 10, "stepSeconds": 2.0, "computeSeconds": [1.5],
                          "waitSeconds": [0.5]}}
    progress = with_estimate(scraped, NOW)
    assert progress["percent"] == 42
    assert RFC3339_UTC.match(progress["estimatedEndTime"])
    assert progress["estimatedEndTime"] == "2026-12-02T12:01:56Z"  # 58 steps x 2 s
    assert {k: v for k, v in progress.items() if k not in ("percent", "estimatedEndTime")} \
        == scraped and "percent" not in scraped  # the scrape itself is left as it was


def test_a_scrape_without_timed_steps_has_percent_but_no_end() -> None:
    """A new gang (after a restart or a re-plan) has timed no step yet: no estimate, rather
    than one from the gang before (its timing is not in this scrape)."""
    progress = with_estimate({"step": 40, "totalSteps": 100, "samplesPerSecond": 99.0}, NOW)
    assert progress == {"step": 40, "totalSteps": 100, "samplesPerSecond": 99.0, "percent": 40}
    assert with_estimate({"totalSteps": 100}, NOW) == {"totalSteps": 100}  # no step yet


RUNNING = {"step": 42, "totalSteps": 100, "percent": 42,
           "estimatedEndTime": "2026-12-02T12:01:56Z"}


def test_the_end_is_shown_only_while_running() -> None:
    assert for_phase(RUNNING, "Running") == RUNNING
    for phase in ("Pending", "Restarting", "Suspended", "Failed"):
        # The gang that measured the step time is gone or going: its estimate is stale.
        assert for_phase(RUNNING, phase) == {"step": 42, "totalSteps": 100, "percent": 42}
    assert for_phase(None, "Restarting") is None


def test_succeeded_is_100_percent_and_no_end() -> None:
    assert for_phase(RUNNING, "Succeeded") == {"step": 42, "totalSteps": 100, "percent": 100}
    assert for_phase(None, "Succeeded") == {"percent": 100}  # rank 0 never reported a step
