"""The timing split from rank 0's page to status.progress.timing: the trainer's own
Prometheus series (cephalo.trainer.metrics, real prometheus_client output) parsed by the
operator's progress scrape; a page missing a rank or carrying a non-finite sum has none."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from cephalo.api.replan import MAX_TIMED_RANKS
from cephalo.api.status import Progress
from cephalo.operator.progress import parse_progress_checked
from cephalo.trainer.metrics import TrainerMetrics


def _page(steps: list[tuple[float, list[float], list[float]]], rank: int = 0) -> str:
    metrics = TrainerMetrics(rank, 0, None)
    for step_seconds, compute, wait in steps:
        metrics.time_ranks(step_seconds, compute, wait)
    return generate_latest(metrics.registry).decode()


def test_means_over_the_timed_steps_reach_status() -> None:
    page = _page([(0.5, [0.1, 0.2], [0.3, 0.1]), (0.7, [0.3, 0.2], [0.3, 0.5])])
    timing = parse_progress_checked(page)["timing"]
    assert timing["steps"] == 2 and timing["stepSeconds"] == pytest.approx(0.6)
    assert timing["computeSeconds"] == pytest.approx([0.2, 0.2])
    assert timing["waitSeconds"] == pytest.approx([0.3, 0.3])
    Progress.model_validate({"timing": timing})  # what the CRD's status schema takes


def test_no_split_no_timing() -> None:
    assert "timing" not in parse_progress_checked(_page([]))  # no timed step yet
    assert "timing" not in parse_progress_checked(_page([(0.5, [0.1], [0.2])], rank=1))
    too_many = [0.1] * (MAX_TIMED_RANKS + 1)
    assert "timing" not in parse_progress_checked(_page([(0.5, too_many, too_many)]))
    page = _page([(0.5, [0.1, 0.2], [0.3, 0.1])])
    missing = "\n".join(line for line in page.splitlines()
                        if 'cephalo_rank_wait_seconds_total{of_rank="1"' not in line) + "\n"
    assert "timing" not in parse_progress_checked(missing)
    nan = page.replace('cephalo_timed_step_seconds_total{rank="0"} 0.5',
                       'cephalo_timed_step_seconds_total{rank="0"} NaN')
    assert nan != page and "timing" not in parse_progress_checked(nan)
