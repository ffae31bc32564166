"""Status discipline and pod classification, pure: one status write per pass, Events after it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cephalo.api import CephaloJob
from cephalo.api.job import Phase
from cephalo.operator import context
from cephalo.operator.config import OperatorConfig
from cephalo.operator.disruptions import PodFates, Verdict
from cephalo.operator.kube import ApiError, owned_by
from cephalo.operator.status import JobPhase, PodPhase, disruption


class FlakyStatusApi:
    """Stands in for AsyncKube: the status PATCH answers 500 `fail` times, optionally after
    applying the patch (a lost reply); GET returns what is stored."""

    def __init__(self, fail: int = 0, applied_anyway: bool = False) -> None:
        self.body: dict[str, Any] = {"metadata": {"name": "j", "namespace": "ns", "uid": "u1",
                                                  "generation": 1}, "status": {}}
        self.fail, self.applied_anyway, self.patches = fail, applied_anyway, 0

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patches += 1
        if self.fail and not self.applied_anyway:
            self.fail -= 1
            raise ApiError(500, "InternalError", "etcd timeout")
        status = self.body["status"]
        for k, v in patch["status"].items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        if self.fail:
            self.fail -= 1
            raise ApiError(500, "InternalError", "reply lost")
        return self.body

    async def get(self, path: str) -> dict[str, Any]:
        return self.body


def _ctx(api: FlakyStatusApi) -> context.JobContext:
    return context.JobContext(api, OperatorConfig.from_env(), {**api.body, "status": {}},
                              CephaloJob.model_construct())


@pytest.fixture()
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(context.kopf, "event", lambda body, type, reason, message:
                        events.append((reason, message)))
    return events


def _decide(ctx: context.JobContext, done: list[str]) -> None:
    async def act() -> None:
        done.append("stopped ranks")

    asyncio.run(ctx.write_status(JobPhase.PLANNING, "planning"))
    asyncio.run(ctx.write_status(JobPhase.RESTARTING, "restart", {"Running": (
        "False", "RankFailed", "rank 1")}, restarts=1))
    ctx.event("Warning", "GangRestart", "rank 1 failed")
    ctx.after_write(act)


def test_one_status_write_per_pass_then_events_and_actions(posted: list) -> None:
    api, done = FlakyStatusApi(), []
    ctx = _ctx(api)
    _decide(ctx, done)
    assert posted == [] and done == []  # nothing happens before the write
    asyncio.run(ctx.flush())
    assert api.patches == 1 and api.body["status"]["phase"] == "Restarting"
    assert api.body["status"]["restarts"] == 1 and api.body["status"]["observedGeneration"] == 1
    assert posted == [("GangRestart", "rank 1 failed")] and done == ["stopped ranks"]


def test_a_failed_status_write_announces_nothing(posted: list) -> None:
    api, done = FlakyStatusApi(fail=1), []
    ctx = _ctx(api)
    _decide(ctx, done)
    with pytest.raises(ApiError):
        asyncio.run(ctx.flush())
    assert posted == [] and done == [] and api.body["status"] == {}


def test_a_write_whose_reply_was_lost_still_announces_once(posted: list) -> None:
    api, done = FlakyStatusApi(fail=1, applied_anyway=True), []
    ctx = _ctx(api)
    _decide(ctx, done)
    asyncio.run(ctx.flush())
    assert posted == [("GangRestart", "rank 1 failed")] and done == ["stopped ranks"]


def test_job_phases_are_one_typed_set_equal_to_the_crd_enum() -> None:
    assert {p.value for p in JobPhase} == set(Phase.__args__)
    assert PodPhase.RUNNING == "Running" and "Restarting" not in {p.value for p in PodPhase}
    with pytest.raises(ValueError):
        JobPhase("Evicted")


def test_disruptions_are_told_apart_from_failures() -> None:
    def pod(**status: Any) -> dict[str, Any]:
        return {"metadata": {"name": "p"}, "status": status}

    preempted = pod(phase="Running", conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
        "message": "preempting"}])
    assert disruption(preempted) == "PreemptionByScheduler: preempting"
    assert disruption(pod(phase="Failed", reason="Evicted")) == "Evicted"
    assert disruption(pod(phase="Failed", conditions=[{"type": "DisruptionTarget",
                                                       "status": "False"}])) is None
    assert disruption(pod(phase="Failed", reason="Error")) is None  # a crash is a failure


def test_children_count_only_with_the_jobs_own_uid() -> None:
    def child(*refs: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"ownerReferences": list(refs)}}

    assert owned_by(child({"uid": "u1", "controller": True}), "u1")
    assert not owned_by(child({"uid": "u0", "controller": True}), "u1")  # the old job's
    assert not owned_by(child({"uid": "u1"}), "u1")  # not its controller
    assert not owned_by({"metadata": {}}, "u1")  # orphaned


def _rank_pod(uid: str, name: str = "j-rank-1", disrupted: bool = False,
              attempt: str = "0") -> dict:
    conditions = [{"type": "DisruptionTarget", "status": "True",
                   "reason": "PreemptionByScheduler"}] if disrupted else []
    return {"metadata": {"namespace": "ns", "name": name, "uid": uid,
                         "ownerReferences": [{"uid": "job", "controller": True}],
                         "labels": {"cephalo.dev/attempt": attempt},
                         "annotations": {"cephalo.dev/config-hash": "h"}},
            "status": {"phase": "Running", "conditions": conditions}}


LAUNCH0, LAUNCH1 = ("job", "0", "h"), ("job", "1", "h")


def test_a_missing_pod_is_judged_by_its_deletion_event_once_the_watch_delivers_it() -> None:
    fates = PodFates()
    fates.note("ADDED", _rank_pod("a"))
    # The look missed the pod before its DELETED event came: wait (no verdict yet) ...
    assert fates.missing("ns", "j-rank-1", LAUNCH0, 100.0, 30.0) == Verdict(True, None)
    assert fates.missing("ns", "j-rank-1", LAUNCH0, 129.0, 30.0) == Verdict(True, None)
    # ... until the event says why: its last state carries the preemption.
    fates.note("DELETED", _rank_pod("a", disrupted=True))
    assert fates.missing("ns", "j-rank-1", LAUNCH0, 129.5, 30.0) == Verdict(
        False, "PreemptionByScheduler")
    # A deletion with nothing that says disrupted: vanished, judged at once.
    fates.note("DELETED", _rank_pod("b", name="j-rank-2"))
    assert fates.missing("ns", "j-rank-2", LAUNCH0, 130.0, 30.0) == Verdict(False, None)


def test_a_deletion_event_that_never_comes_is_waited_for_the_grace_only() -> None:
    fates = PodFates()
    assert fates.missing("ns", "j-rank-0", LAUNCH0, 10.0, 30.0).waiting  # first missed
    assert fates.missing("ns", "j-rank-0", LAUNCH0, 39.9, 30.0).waiting
    assert fates.missing("ns", "j-rank-0", LAUNCH0, 40.0, 30.0) == Verdict(False, None)
    assert fates.missing("ns", "j-rank-0", LAUNCH0, 40.1, 30.0) == Verdict(False, None)
    assert fates.missing("ns", "j-rank-0", LAUNCH1, 41.0, 0.0) == Verdict(False, None)


def test_pod_fates_never_take_an_earlier_attempts_pod_for_the_missing_one() -> None:
    fates = PodFates()
    fates.note("MODIFIED", _rank_pod("a", disrupted=True))
    fates.note("MODIFIED", _rank_pod("a"))  # the same pod's later event: still disrupted
    fates.note("DELETED", _rank_pod("a"))
    assert fates.missing("ns", "j-rank-1", LAUNCH0, 1.0, 30.0).disruption == \
        "PreemptionByScheduler"
    # The next attempt's pod of that name, gone before its own deletion event came: the
    # earlier pod's deletion and disruption are not its.
    fates.note("ADDED", _rank_pod("b", attempt="1"))
    assert fates.missing("ns", "j-rank-1", LAUNCH1, 2.0, 30.0) == Verdict(True, None)
    fates.note("DELETED", _rank_pod("b", attempt="1"))
    assert fates.missing("ns", "j-rank-1", LAUNCH1, 3.0, 30.0) == Verdict(False, None)


def test_pod_fates_stay_bounded() -> None:
    fates = PodFates(limit=2)
    for i in range(3):
        fates.note("DELETED", _rank_pod(f"u{i}", name=f"p{i}", disrupted=True))
        fates.missing("ns", f"q{i}", LAUNCH0, 0.0, 30.0)
    assert fates.missing("ns", "p0", LAUNCH0, 1.0, 30.0).waiting  # forgotten: not seen
    assert fates.missing("ns", "p2", LAUNCH0, 1.0, 30.0).disruption == "PreemptionByScheduler"
    assert len(fates._seen) <= 2 and len(fates._missed) <= 2
