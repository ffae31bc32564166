"""The operator measures the micro-batch sizes a plan assigns beyond the profiled ones before
it uses the plan (issue 46 item 3): one extra profiler pod per product, cached, then the
job plans again and runs. The real operator process against the API emulator; the test
plays the profiler pods (their termination message), as test_operator_e2e.py does."""

from __future__ import annotations

from typing import Any

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import OperatorProcess, apply_job, job_status, pods, set_pod, wait_for
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    events,
    phases,
    plan_of,
    run_ranks,
    start_operator_fixture,
)

from cephalo.api import GpuProfile, parse_job
from cephalo.api.profile import profiled_sizes
from cephalo.planner import estimate_profile, lookup_gpu

pytestmark = pytest.mark.asyncio


@pytest.fixture(name="operator")
def operator_fixture(start_operator: Any) -> OperatorProcess:
    """The operator with the extra passes on (CEPHALO_MEASURE_EXTRA_SIZES; off by default
    for now)."""
    return start_operator(CEPHALO_MEASURE_EXTRA_SIZES="true")

PROFILED = [1, 2]


def _sizes(pod: dict[str, Any]) -> list[int] | None:
    """The sizes a profiler pod was told to measure (None: the job's own)."""
    command = pod["spec"]["containers"][0]["command"]
    if "--micro-batch-sizes" not in command:
        return None
    return [int(m) for m in command[command.index("--micro-batch-sizes") + 1].split(",")]


def _measured_json(pod: dict[str, Any], body: dict[str, Any]) -> str:
    """What the profiler would print: the product's profile at the pod's sizes, measured
    (the catalog's figures stand in for the GPU's)."""
    spec = parse_job(body).spec
    product = pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    sizes = _sizes(pod) or spec.planner.profile_micro_batch_sizes
    profile = estimate_profile(lookup_gpu(product).name, spec.model.resolve(), spec.precision,
                               sizes).model_copy(update={"source": "measured"})
    return profile.to_compact_json()


async def _finish_next_profiler(api: ApiEmulator, body: dict[str, Any],
                                done: set[str]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    pod = await wait_for("a profiler pod", lambda: next(
        (p for p in pods(api, NS, "profiler", name) if p["metadata"]["name"] not in done
         and not p["metadata"].get("deletionTimestamp")), None))
    done.add(pod["metadata"]["name"])
    await set_pod(api, NS, pod["metadata"]["name"], "Succeeded",
                  message=_measured_json(pod, body))
    return pod


async def test_a_plan_with_an_unmeasured_size_profiles_it_once_then_runs(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("sizes", gpuPools=[{"product": "L4"}],
                    planner={"chooseGpus": False, "profileMicroBatchSizes": PROFILED})
    await apply_job(emulator, body)
    done: set[str] = set()
    first = await _finish_next_profiler(emulator, body, done)
    assert _sizes(first) is None  # the job's own sizes first
    # gpt-small at batch 64 on the two L4s: the first plan takes microbatches above 2.
    extra = await _finish_next_profiler(emulator, body, done)
    sizes = _sizes(extra)
    assert sizes and min(sizes) > max(PROFILED), sizes
    listed = ", ".join(map(str, sizes))
    noun = "size" if len(sizes) == 1 else "sizes"
    said = f"micro-batch {noun} {listed} of L4 (beyond the profiled 1-2)"
    ranks = await run_ranks(emulator, "sizes")
    plan = plan_of(emulator, "sizes")
    assert len(ranks) == plan.world_size
    # Every size the plan uses was measured; nothing is marked extrapolated.
    measured = set(PROFILED) | set(sizes)
    assert {r.micro_batch_size for r in plan.ranks if r.batch_size} <= measured
    assert not any(r.extrapolated for r in plan.ranks) and "extrapolated" not in plan.to_json()
    # Exactly one extra pass; its profile cached under its own key, beside the first.
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
    await wait_for("Running", lambda: job_status(emulator, NS, "sizes").get("phase") == "Running")


def parse_profile(cm: dict[str, Any]) -> GpuProfile:
    return GpuProfile.model_validate_json(cm["data"]["profile.json"])


async def test_a_pass_that_comes_back_without_its_sizes_is_not_asked_again(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    """Regression (found by test_operator_netprobe_shared, whose simulated profiler ignores
    --micro-batch-sizes): a profiler whose extra pass came back without the sizes it was
    asked for had its pod deleted and made again, Profiling <-> Planning without end. A pass
    is done once its result is cached: the job plans with what was measured, marked
    extrapolated, and runs; at most MAX_MEASURE_ROUNDS passes per product."""
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
                      message=_measured_json(own, body))
    ranks = await run_ranks(emulator, "stubborn")
    profilers = [name for _, name in emulator.created("pods") if "-profile-" in name]
    assert 2 <= len(profilers) <= 3 and set(profilers) == answered, profilers
    plan = plan_of(emulator, "stubborn")
    assert len(ranks) == plan.world_size
    assert any(r.extrapolated for r in plan.ranks if r.batch_size), plan.to_json()
