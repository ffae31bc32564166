"""Status discipline and pod classification, pure: one status write per pass, Events after it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cephalo.api import CephaloJob
from cephalo.api.job import Phase
from cephalo.operator import context
from cephalo.operator.config import OperatorConfig
from cephalo.operator.disruptions import DisruptionMemory
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


def test_disruption_memory_forgets_on_a_new_pod_of_the_same_name_and_stays_bounded() -> None:
    def pod(uid: str, name: str = "j-rank-1", disrupted: bool = True) -> dict:
        conditions = [{"type": "DisruptionTarget", "status": "True",
                       "reason": "PreemptionByScheduler"}] if disrupted else []
        return {"metadata": {"namespace": "ns", "name": name, "uid": uid},
                "status": {"phase": "Running", "conditions": conditions}}

    seen = DisruptionMemory(limit=2)
    seen.note(pod("a", disrupted=False))
    assert seen.reason("ns", "j-rank-1") is None
    seen.note(pod("a"))
    assert seen.reason("ns", "j-rank-1") == "PreemptionByScheduler"
    seen.note(pod("a", disrupted=False))  # the same pod's older event: still disrupted
    assert seen.reason("ns", "j-rank-1") == "PreemptionByScheduler"
    seen.note(pod("b", disrupted=False))  # the next attempt's pod of that name
    assert seen.reason("ns", "j-rank-1") is None
    for i in range(3):
        seen.note(pod(f"u{i}", name=f"p{i}"))
    assert seen.reason("ns", "p0") is None and seen.reason("ns", "p2") is not None
