"""Planning in a limited child process (issue 11, defect 4): a spec that makes the planner
run long or allocate without bound fails that job with a one-line reason; the operator
process never runs out of memory or time itself."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
from kube_fixtures import job_body
from kubelet import JOBS, apply_job, call, finish_profilers
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    SMALL,
    cond,
    operator_fixture,
    start_operator_fixture,
    wait_phase,
)

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.api.job import CephaloJobSpec
from cephalo.operator.planning import PlanningFailed, _receive, plan_job
from cephalo.planner import solve, worker

MIB = 1024**2


def _spec(batch: int, preset: str = "gpt-tiny") -> CephaloJobSpec:
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": {"model": {"preset": preset}, "globalBatchSize": batch}}).spec


CLUSTER = ClusterSpec(groups=[GpuGroup(product="A10G", count=2),
                              GpuGroup(product="T4", count=3)])


def _plan(spec: CephaloJobSpec, cluster: ClusterSpec = CLUSTER, timeout_seconds: float = 120,
          memory_bytes: int = 512 * MIB):
    return asyncio.run(plan_job(spec, cluster, None, timeout_seconds=timeout_seconds,
                                memory_bytes=memory_bytes))


def test_child_plan_equals_the_in_process_plan() -> None:
    spec = _spec(64)
    assert _plan(spec).to_json() == solve(spec, CLUSTER).to_json()


def test_infeasible_job_fails_with_the_planners_message() -> None:
    with pytest.raises(PlanningFailed) as info:
        _plan(_spec(64, "gpt-6.7b"), ClusterSpec(groups=[GpuGroup(product="T4", count=1)]))
    assert info.value.reason == "Infeasible"
    assert "training state" in str(info.value) and "\n" not in str(info.value)


def test_unknown_gpu_is_invalid_spec() -> None:
    with pytest.raises(PlanningFailed) as info:
        _plan(_spec(8), ClusterSpec(groups=[GpuGroup(product="Voodoo-5", count=1)]))
    assert info.value.reason == "InvalidSpec" and "Voodoo-5" in str(info.value)


def test_memory_allowance_is_enforced_in_the_child() -> None:
    """B = 65536 needs ~160 MiB of tables; with a 16 MiB allowance the child's MemoryError
    becomes the job's failure, not the operator's."""
    with pytest.raises(PlanningFailed) as info:
        _plan(_spec(65_536), memory_bytes=16 * MIB)
    assert info.value.reason == "PlanningFailed"
    assert "16 MiB memory allowance" in str(info.value), str(info.value)


def test_time_limit_stops_the_child() -> None:
    """A child still planning at the limit is stopped. The planner now solves even the batch
    maximum in about a second, so the limit here is far below that (the child cannot even
    finish starting in 10 ms)."""
    with pytest.raises(PlanningFailed) as info:
        _plan(_spec(65_536, "gpt-2.7b"), timeout_seconds=0.01)
    assert info.value.reason == "PlanningFailed"
    assert "longer than 0.01 s" in str(info.value)
    assert not [p for p in multiprocessing.active_children() if p.name == "cephalo-planner"]


def test_a_planner_bug_is_one_line_and_names_the_exception(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> None:
        raise KeyError("unit 7")

    monkeypatch.setattr(worker, "solve", broken)
    request = worker.encode_request(_spec(8), CLUSTER, None)
    assert worker.run_request(request, 64 * MIB) == (
        "error", "PlanningFailed", "the planner failed: KeyError: 'unit 7'")


def test_a_child_that_dies_without_an_answer_is_reported() -> None:
    receiver, sender = multiprocessing.Pipe(duplex=False)
    sender.close()
    assert _receive(receiver, 5.0) == "died"


# ---- in the operator: a failed plan fails the job, a fixed spec recovers ----------------------
@pytest.mark.asyncio
async def test_planning_out_of_memory_fails_the_job_not_the_operator(emulator, start_operator
                                                                     ) -> None:

    operator = start_operator(CEPHALO_PLANNING_MEMORY_BYTES=str(1 * MIB))
    # The batch maximum needs ~100 MiB of tables: certain to pass a 1 MiB allowance (a small
    # plan may fit in memory the child's heap already had).
    body = job_body("oom", **{**SMALL, "globalBatchSize": 65_536})
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    status = await wait_phase(emulator, "oom", "Failed")
    assert "1 MiB memory allowance" in status["message"]
    assert cond(emulator, "oom", "Failed")["reason"] == "PlanningFailed"
    assert operator.proc.poll() is None  # the operator itself carries on


@pytest.mark.asyncio
async def test_a_job_refused_for_its_spec_recovers_when_the_spec_is_fixed(emulator, operator
                                                                          ) -> None:

    await apply_job(emulator, job_body("fixme", **{**SMALL, "globalBatchSize": 0}))
    await wait_phase(emulator, "fixme", "Failed")
    assert cond(emulator, "fixme", "Failed")["reason"] == "InvalidSpec"
    await call(emulator, "PATCH", JOBS.format(ns=NS) + "/fixme",
               {"spec": {"globalBatchSize": 64}})
    status = await wait_phase(emulator, "fixme", "Profiling")
    assert status["observedGeneration"] == 2 and "completionTime" not in status
    assert cond(emulator, "fixme", "Failed")["status"] == "False"


def test_at_most_two_planning_children_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each child may use the whole memory allowance: their number is bounded."""
    import cephalo.operator.planning as planning

    running, peak = 0, 0
    start = planning._start

    def counting_start(*args: object):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        return start(*args)

    stop = planning._stop

    def counting_stop(process: object) -> None:
        nonlocal running
        stop(process)
        running -= 1

    monkeypatch.setattr(planning, "_start", counting_start)
    monkeypatch.setattr(planning, "_stop", counting_stop)

    async def five() -> list[object]:
        return await asyncio.gather(*(plan_job(_spec(16), CLUSTER, None, timeout_seconds=120,
                                               memory_bytes=512 * MIB) for _ in range(5)))

    plans = asyncio.run(five())
    assert len(plans) == 5 and 1 <= peak <= planning.MAX_CONCURRENT_PLANS
