"""status.rebalance from rank 0's page (issue 45 item 3): the page is the one the trainer's
own metrics code serves (cephalo.trainer.metrics, not a hand-written fixture), parsed as the
operator's scrape parses it; the job's change count across gangs, the Event per change and
the per-rank batch series."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import generate_latest

from cephalo.api import CephaloJob
from cephalo.api.status import CephaloJobStatus
from cephalo.operator import context, metrics
from cephalo.operator.config import OperatorConfig
from cephalo.operator.progress import parse_progress_checked
from cephalo.operator.rebalance_status import NOT_REBALANCED, REBALANCED, next_status, observe
from cephalo.operator.status import REBALANCE
from cephalo.trainer.metrics import TrainerMetrics

NOW = "2026-12-06T15:00:00Z"
REASON = "split [32, 8] -> [34, 6] after step 10: the slowest rank's compute predicted 1.10x"
HELD = ("split [32, 8] kept short of [36, 4] after step 20: rank 0 would need 36 samples, "
        "its memory holds 32 at microbatch 8")


def _page(changes: list[tuple[list[int], list[int], int]],
          held: tuple[int, str] | None = None) -> str:
    """Rank 0's page after the plan's split [32, 8] and then `changes` (split, microbatches,
    step); `held`: (step, reason) memory keeps the split short since."""
    trainer = TrainerMetrics(rank=0, port=0, predicted_step_seconds=1.0)
    trainer.show_split([32, 8], [4, 1])
    for split, micro, step in changes:
        trainer.show_split(split, micro, changed_after_step=step, reason=REASON)
    if held is not None:
        trainer.show_held(*held)
    return generate_latest(trainer.registry).decode()


def test_the_trainers_page_gives_the_split_in_force_and_its_last_change() -> None:
    plain = parse_progress_checked(_page([]))[REBALANCE]
    assert plain == {"batchSizes": [32, 8], "microBatches": [4, 1], "changes": 0}
    moved = parse_progress_checked(_page([([34, 6], [5, 1], 10)]))[REBALANCE]
    assert moved == {"batchSizes": [34, 6], "microBatches": [5, 1], "changes": 1,
                     "lastChangeStep": 10, "lastChangeReason": REASON}


def test_the_trainers_page_says_why_memory_keeps_the_split_short() -> None:
    held = parse_progress_checked(_page([], held=(20, HELD)))[REBALANCE]
    assert held == {"batchSizes": [32, 8], "microBatches": [4, 1], "changes": 0,
                    "heldStep": 20, "heldReason": HELD}
    status, _ = next_status(None, held, "pod-a", NOW)
    assert (status["heldStep"], status["heldReason"]) == (20, HELD)
    assert CephaloJobStatus.model_validate({"rebalance": status}).rebalance is not None
    # Memory binds no more (the speeds changed back): the reason goes from status.
    free = parse_progress_checked(_page([]))[REBALANCE]
    status, _ = next_status(status, free, "pod-a", NOW)
    assert "heldReason" not in status and "heldStep" not in status


@pytest.mark.parametrize("page", [
    'cephalo_step{rank="0"} 3\n',  # a trainer older than live rebalancing
    'cephalo_split_batch_size{of_rank="0",rank="0"} 32\n'
    'cephalo_split_batch_size{of_rank="2",rank="0"} 8\n'  # rank 1 missing
    'cephalo_split_micro_batches{of_rank="0",rank="0"} 4\n'
    'cephalo_split_micro_batches{of_rank="2",rank="0"} 1\n',
    'cephalo_split_batch_size{of_rank="0",rank="0"} 3.5\n'  # not a count
    'cephalo_split_micro_batches{of_rank="0",rank="0"} 1\n',
    'cephalo_split_batch_size{of_rank="0",rank="0"} 4\n',  # no microbatch counts
])
def test_a_page_without_a_whole_split_has_none(page: str) -> None:
    assert REBALANCE not in parse_progress_checked(page)


def test_the_jobs_count_adds_each_gangs_changes() -> None:
    first = {"batchSizes": [34, 6], "microBatches": [5, 1], "changes": 1,
             "lastChangeStep": 10, "lastChangeReason": REASON}
    status, seen = next_status(None, first, "pod-a", NOW)
    assert seen == 1 and status["changes"] == 1 and status["lastChangeTime"] == NOW
    again, seen = next_status(status, first, "pod-a", "later")  # the same page again
    assert seen == 0 and again["changes"] == 1 and again["lastChangeTime"] == NOW
    two_more = {**first, "batchSizes": [36, 4], "changes": 3, "lastChangeStep": 30}
    status, seen = next_status(again, two_more, "pod-a", "later")
    assert seen == 2 and status["changes"] == 3 and status["lastChangeStep"] == 30
    # A new gang (restarted from a checkpoint) counts from 0 under the split it resumed.
    resumed = {"batchSizes": [36, 4], "microBatches": [5, 1], "changes": 0}
    status, seen = next_status(status, resumed, "pod-b", "later still")
    assert seen == 0 and status["changes"] == 3 and status["gangChanges"] == 0
    assert status["lastChangeStep"] == 30  # the last change is still that one
    status, seen = next_status(status, {**resumed, "changes": 1, "lastChangeStep": 41,
                                        "lastChangeReason": "r"}, "pod-b", "t")
    assert seen == 1 and status["changes"] == 4 and status["lastChangeReason"] == "r"
    CephaloJobStatus.model_validate({"rebalance": status})  # the CRD's model takes it


class StatusApi:
    """AsyncKube's status PATCH and GET on one stored job."""

    def __init__(self) -> None:
        self.body: dict[str, Any] = {"metadata": {"name": "rb", "namespace": "ns",
                                                  "uid": "u1", "generation": 1},
                                     "status": {"phase": "Running"}}

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.body["status"].update(patch["status"])
        return self.body

    async def get(self, path: str) -> dict[str, Any]:
        return self.body


def test_a_change_is_written_with_an_event_and_the_per_rank_batch_series(
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(context.kopf, "event", lambda body, type, reason, message:
                        events.append((type, reason, message)))
    api = StatusApi()

    def scrape(page: str) -> None:
        ctx = context.JobContext(api, OperatorConfig.from_env(), api.body,
                                 CephaloJob.model_construct())
        observe(ctx, parse_progress_checked(page).get(REBALANCE), "pod-a")
        asyncio.run(ctx.flush())

    def batch(rank: int) -> float | None:
        return metrics.RANK_BATCH.labels("ns", "rb", str(rank))._value.get() \
            if ("ns", "rb", str(rank)) in metrics.RANK_BATCH._metrics else None

    before = metrics.REBALANCES.labels("ns", "rb")._value.get()
    scrape(_page([]))
    assert api.body["status"]["rebalance"]["batchSizes"] == [32, 8] and not events
    assert (batch(0), batch(1)) == (32, 8)
    scrape(_page([([34, 6], [5, 1], 10)]))
    assert api.body["status"]["rebalance"]["changes"] == 1
    assert [(t, r) for t, r, _ in events] == [("Normal", REBALANCED)]
    assert REASON in events[0][2] and "no restart" in events[0][2]
    assert (batch(0), batch(1)) == (34, 6)
    assert metrics.REBALANCES.labels("ns", "rb")._value.get() == before + 1
    scrape(_page([([34, 6], [5, 1], 10), ([36, 4], [5, 1], 20), ([37, 3], [5, 1], 30)]))
    assert events[-1][2].startswith("2 changes since the last look")
    assert len(events) == 2 and api.body["status"]["rebalance"]["changes"] == 3
    # Memory keeps the split short: one Event when that starts, none while it lasts.
    moved = [([34, 6], [5, 1], 10), ([36, 4], [5, 1], 20), ([37, 3], [5, 1], 30)]
    scrape(_page(moved, held=(40, HELD)))
    scrape(_page(moved, held=(40, HELD)))
    assert [(t, r) for t, r, _ in events[2:]] == [("Normal", NOT_REBALANCED)]
    assert HELD in events[-1][2] and "re-planning" in events[-1][2]
    assert api.body["status"]["rebalance"]["heldReason"] == HELD
    metrics.set_phase("ns", "rb", None)  # the job is gone: so are its series
    assert batch(0) is None and batch(1) is None


def test_a_change_after_the_last_scrape_comes_with_rank_0s_final_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cephalo.operator.progress import final_progress

    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(context.kopf, "event", lambda body, type, reason, message:
                        events.append((type, reason, message)))
    trainer = TrainerMetrics(rank=0, port=0, predicted_step_seconds=1.0)
    trainer.show_split([32, 8], [4, 1])
    trainer.observe(step=30, loss=2.0, step_seconds=1.0, samples_per_second=40.0,
                    tokens_per_second=1.0, tflops=0.0, wait_seconds_by_op={}, local_rank=0)
    api = StatusApi()
    scraped = parse_progress_checked(generate_latest(trainer.registry).decode())[REBALANCE]
    api.body["status"]["rebalance"], _ = next_status(None, scraped, "pod-a", NOW)
    # The last change, after step 29, was not scraped before rank 0 ended.
    trainer.show_split([34, 6], [5, 1], changed_after_step=29, reason="x" * 5000)
    message = trainer.final_progress(30).model_dump_json(by_alias=True, exclude_none=True)
    assert len(message) < 4096  # a termination message (the reason is cut)
    ctx = context.JobContext(api, OperatorConfig.from_env(), api.body,
                             CephaloJob.model_validate(_final_job()))
    progress = final_progress(ctx, message, "pod-a")
    assert progress is not None and "rebalance" not in progress and progress["step"] == 30
    asyncio.run(ctx.flush())
    rebalance = api.body["status"]["rebalance"]
    assert rebalance["batchSizes"] == [34, 6] and rebalance["changes"] == 1
    assert rebalance["lastChangeStep"] == 29 and [r for _, r, _ in events] == [REBALANCED]


def _final_job() -> dict[str, Any]:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "rb", "namespace": "ns"},
            "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 40,
                     "training": {"steps": 30}}}
