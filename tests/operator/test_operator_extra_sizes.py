"""The operator measures the micro-batch sizes a plan assigns beyond the profiled ones
before it uses the plan (issue 46 item 3), by default: one extra profiler pod per product,
cached, then the job plans again and runs. The real operator process against the API
emulator; the test plays each product's first profiler pass (finish_profilers, as
test_operator_e2e.py does), the harness's ExtraPassKubelet the extra one."""

from __future__ import annotations

from typing import Any

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import (
    ExtraPassKubelet,
    OperatorProcess,
    apply_job,
    finish_profilers,
    is_extra_pass,
    job_status,
    pods,
    profiler_sizes,
    real_profile_json,
    set_pod,
    wait_for,
)
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    events,
    operator_fixture,
    phases,
    plan_of,
    run_ranks,
    start_operator_fixture,
    wait_phase,
)

from cephalo.api import GpuProfile
from cephalo.api.profile import profiled_sizes

pytestmark = pytest.mark.asyncio

PROFILED = [1, 2]


def _profilers(api: ApiEmulator, job: str) -> list[str]:
    """Every profiler pod the operator ever created for `job`, in order."""
    return [name for _, name in api.created("pods") if name.startswith(f"{job}-profile-")]


async def test_a_plan_with_an_unmeasured_size_profiles_it_once_then_runs(
        emulator: ApiEmulator, operator: OperatorProcess,
        extra_passes: ExtraPassKubelet) -> None:
    """The must-show on the emulator, with the operator's defaults."""
    body = job_body("sizes", gpuPools=[{"product": "L4"}], training={"steps": 10},
                    planner={"chooseGpus": False, "profileMicroBatchSizes": PROFILED})
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=1)  # the job's own sizes first
    # gpt-small at batch 64 on the two L4s: the first plan takes microbatches above 2.
    ranks = await run_ranks(emulator, "sizes")
    assert len(extra_passes.answered) == 1, extra_passes.answered
    extra = next(p for p in emulator.history("pods", NS, extra_passes.answered[0])
                 if is_extra_pass(p))
    sizes = profiler_sizes(extra, body)
    assert sizes and min(sizes) > max(PROFILED), sizes
    listed = ", ".join(map(str, sizes))
    noun = "size" if len(sizes) == 1 else "sizes"
    said = f"micro-batch {noun} {listed} of L4 (beyond the profiled 1-2)"
    plan = plan_of(emulator, "sizes")
    assert len(ranks) == plan.world_size
    # Every size the plan uses was measured; nothing is marked extrapolated.
    measured = set(PROFILED) | set(sizes)
    assert {r.micro_batch_size for r in plan.ranks if r.batch_size} <= measured
    assert not any(r.extrapolated for r in plan.ranks) and "extrapolated" not in plan.to_json()
    # Exactly one extra pass (two profiler pods in all); its profile cached under its own
    # key, beside the first.
    assert len(_profilers(emulator, "sizes")) == 2, emulator.created("pods")
    assert len(emulator.created("pods")) == len(ranks) + 2, emulator.created("pods")
    caches = [c for c in emulator.list_objects("configmaps", NS)
              if c["metadata"].get("labels", {}).get("cephalo.dev/profile") == "true"]
    assert len(caches) == 2
    assert sorted(len(profiled_sizes(parse_profile(c))) for c in caches) == \
        sorted([len(PROFILED), len(sizes)])
    # What the user saw: the status while the pass ran, and an Event.
    messages = [(v.get("status") or {}).get("message", "")
                for v in emulator.history("cephalojobs", NS, "sizes", group="cephalo.dev")]
    assert f"profiling {said}" in messages, messages
    await wait_for("the event", lambda: any(
        r == "ProfilingSizes" and said in m for _, r, m in events(emulator, "sizes")))
    assert phases(emulator, "sizes")[:3] == ["Profiling", "Planning", "Profiling"]
    await wait_phase(emulator, "sizes", "Running")
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
    await wait_phase(emulator, "sizes", "Succeeded")
    # The plan it ran to the end with is the one without an extrapolated rank.
    assert plan_of(emulator, "sizes") == plan
    assert len(_profilers(emulator, "sizes")) == 2


def parse_profile(cm: dict[str, Any]) -> GpuProfile:
    return GpuProfile.model_validate_json(cm["data"]["profile.json"])


async def test_a_pass_that_comes_back_without_its_sizes_is_not_asked_again(
        emulator: ApiEmulator, operator: OperatorProcess,
        extra_passes: ExtraPassKubelet) -> None:
    """Regression (found by test_operator_netprobe_shared, whose simulated profiler ignored
    --micro-batch-sizes): a profiler whose extra pass came back without the sizes it was
    asked for had its pod deleted and made again, Profiling <-> Planning without end. A pass
    is done once its result is cached: the job plans with what was measured, marked
    extrapolated, and runs; at most MAX_MEASURE_ROUNDS passes per product."""
    await extra_passes.stop()  # this test's profiler answers every pass at the job's sizes
    body = job_body("stubborn", gpuPools=[{"product": "L4"}],
                    planner={"chooseGpus": False, "profileMicroBatchSizes": PROFILED})
    await apply_job(emulator, body)
    answered: set[str] = set()
    for _ in range(4):  # the first pass, then at most MAX_MEASURE_ROUNDS extra ones
        pod = await wait_for("a profiler pod or Running", lambda: next(
            (p for p in pods(emulator, NS, "profiler", "stubborn")
             if p["metadata"]["name"] not in answered
             and not p["metadata"].get("deletionTimestamp")), None) or
            job_status(emulator, NS, "stubborn").get("phase") == "Pending")
        if pod is True:  # planned, its ranks created
            break
        answered.add(pod["metadata"]["name"])
        own = {**pod, "spec": {**pod["spec"], "containers": [
            {**pod["spec"]["containers"][0], "command": ["profile"]}]}}
        await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded",
                      message=real_profile_json(own, body))
    ranks = await run_ranks(emulator, "stubborn")
    profilers = _profilers(emulator, "stubborn")
    assert 2 <= len(profilers) <= 3 and set(profilers) == answered, profilers
    plan = plan_of(emulator, "stubborn")
    assert len(ranks) == plan.world_size
    assert any(r.extrapolated for r in plan.ranks if r.batch_size), plan.to_json()
