"""End to end: the real kopf operator process, over HTTP, against the API emulator.

The test plays the kubelet: profiler pods terminate with a real GpuProfile as their
termination message, rank pods run and then succeed or fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from aiohttp import ClientSession, web
from crd_schema import load_schema, pruned, type_errors
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import (
    JOBS,
    WAIT_SECONDS,
    OperatorProcess,
    apply_job,
    call,
    finish_profilers,
    free_port,
    job_status,
    pods,
    set_pod,
    wait_for,
)
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    SMALL,
    cond,
    events,
    extra_passes_asked,
    operator_fixture,
    phases,
    plan_of,
    run_ranks,
    start_operator_fixture,
    wait_phase,
)
from prometheus_client.parser import text_string_to_metric_families

from cephalo.operator.status import parse_time

pytestmark = pytest.mark.asyncio


async def test_cluster_a_job_profiles_plans_trains_and_succeeds(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("gpt")
    await apply_job(emulator, body)
    products = await finish_profilers(emulator, NS, body, count=4)
    assert products == {"NVIDIA-L4", "NVIDIA-RTX-A6000", "Tesla-P40", "Tesla-P100-PCIE-16GB"}
    ranks = await run_ranks(emulator, "gpt")
    status = await wait_for("Running", lambda: (
        s if (s := job_status(emulator, NS, "gpt")).get("phase") == "Running" else None))
    plan = plan_of(emulator, "gpt")
    assert len(ranks) == plan.world_size == status["plan"]["worldSize"]
    assert status["plan"]["predictedSamplesPerSecond"] == pytest.approx(
        plan.predicted_samples_per_second)
    assert sum(status["plan"]["pools"].values()) == plan.world_size
    for pod in ranks:
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]
               if "value" in e}
        rank = plan.ranks[int(env["RANK"])]
        assert pod["metadata"]["name"] == f"gpt-rank-{rank.rank}"
        assert env["WORLD_SIZE"] == str(plan.world_size)
        assert env["CEPHALO_BATCH_SIZE"] == str(rank.batch_size)
        assert env["CEPHALO_NUM_MICRO_BATCHES"] == str(rank.num_micro_batches)
        assert float(env["CEPHALO_SHARD_RATIO"]) == rank.shard_ratio
        assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == rank.pool
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
    await wait_for("Succeeded", lambda: job_status(emulator, NS, "gpt").get("phase") == "Succeeded")
    assert phases(emulator, "gpt") == ["Profiling", "Planning", "Pending", "Running", "Succeeded"]
    final = job_status(emulator, NS, "gpt")
    assert final["completionTime"] and final["observedGeneration"] == 1
    # What the operator wrote survives a real API server: right types, nothing pruned.
    status_schema = load_schema()["properties"]["status"]
    for version in emulator.history("cephalojobs", NS, "gpt", group="cephalo.dev"):
        status = version.get("status") or {}
        assert type_errors(status, status_schema) == []
        assert pruned(status, status_schema) == []
    assert {c["type"]: c["status"] for c in final["conditions"]}["Succeeded"] == "True"
    await wait_for("Succeeded event", lambda: any(
        r == "Succeeded" for _, r, _ in events(emulator, "gpt")))  # Events are posted async
    reasons = [r for _, r, _ in events(emulator, "gpt")]
    for reason in ("Profiled", "Planned", "Running"):
        assert reason in reasons, reasons
    planned = next(m for _, r, m in events(emulator, "gpt") if r == "Planned")
    assert f"{plan.world_size} GPUs" in planned and "even FSDP" in planned
    # Nothing created twice; profiles cached for later jobs; profiler pods cleaned up.
    for plural in ("pods", "configmaps", "services"):
        dup = {k: n for k, n in emulator.created(plural).items() if n > 1}
        assert not dup, f"{plural} created twice: {dup}"
    caches = [c for c in emulator.list_objects("configmaps", NS)
              if c["metadata"].get("labels", {}).get("cephalo.dev/profile") == "true"]
    assert len(caches) == 4 and pods(emulator, NS, "profiler") == []


async def test_rank_failure_gang_restarts_then_succeeds(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("gr", backoffLimit=2, **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    first = await run_ranks(emulator, "gr")
    await wait_phase(emulator, "gr", "Running")
    await set_pod(emulator, NS, "gr-rank-1", "Failed", exit_code=137, message="OOMKilled")
    second = await run_ranks(emulator, "gr")  # all ranks replaced: new uids, attempt 1
    assert {p["metadata"]["uid"] for p in first}.isdisjoint(p["metadata"]["uid"] for p in second)
    for pod in second:
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]
               if "value" in e}
        assert env["CEPHALO_RESTART_ATTEMPT"] == "1"
        assert pod["metadata"]["labels"]["cephalo.dev/attempt"] == "1"
    await wait_phase(emulator, "gr", "Running")
    for pod in second:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
    status = await wait_phase(emulator, "gr", "Succeeded")
    assert status["restarts"] == 1
    assert phases(emulator, "gr")[-4:] == ["Running", "Restarting", "Running", "Succeeded"]
    restart = [m for _, r, m in events(emulator, "gr") if r == "GangRestart"]
    assert len(restart) == 1 and "rank 1" in restart[0] and "exit code 137" in restart[0]
    assert all(n == 2 for (_, name), n in emulator.created("pods").items() if "-rank-" in name)


async def test_backoff_exhausted_fails_with_rank_exit_code_and_message(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("bo", backoffLimit=1, **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    await run_ranks(emulator, "bo")
    await set_pod(emulator, NS, "bo-rank-0", "Failed", exit_code=3, message="boom " * 200)
    await run_ranks(emulator, "bo")
    trace = "Traceback ...\nRuntimeError: NCCL timeout on rank 2"
    await set_pod(emulator, NS, "bo-rank-2", "Failed", exit_code=1, message=trace)
    status = await wait_phase(emulator, "bo", "Failed")
    assert "rank 2" in status["message"] and "exit code 1" in status["message"]
    assert "NCCL timeout on rank 2" in status["message"] and "backoffLimit 1" in status["message"]
    assert cond(emulator, "bo", "Failed")["reason"] == "BackoffLimitExceeded"
    await wait_for("BackoffLimitExceeded event", lambda: any(  # posted after the status write
        r == "BackoffLimitExceeded" for _, r, _ in events(emulator, "bo")))
    # ranks still "running" were stopped to free their GPUs; the failed one is kept for logs
    await wait_for("running ranks deleted", lambda: [
        p["metadata"]["name"] for p in pods(emulator, NS, "trainer", "bo")] == ["bo-rank-2"])


async def test_infeasible_job_fails_with_the_planners_numbers(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("big", model={"preset": "gpt-6.7b"}, globalBatchSize=8,
                    gpuPools=[{"product": "P100", "maxGpus": 1}])
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=1)
    status = await wait_phase(emulator, "big", "Failed")
    assert cond(emulator, "big", "Failed")["reason"] == "Infeasible"
    assert any(ch.isdigit() for ch in status["message"]), status["message"]
    assert pods(emulator, NS, "trainer") == []


async def test_no_gpus_waits_with_a_clear_condition_then_times_out(
        emulator: ApiEmulator, start_operator) -> None:
    # Counted from the pass that writes the condition (reconcile._no_gpus), so the test sees
    # it before the job fails however slow the operator's start (at least 2 s after it: the
    # transition time is in whole seconds); the rest of the 5 s it had was only waiting.
    start_operator(CEPHALO_DISCOVERY_TIMEOUT_SECONDS="3")
    await apply_job(emulator, job_body("nogpu", gpuPools=[{"product": "H100"}]))
    await wait_for("GpusAvailable=False", lambda: cond(emulator, "nogpu", "GpusAvailable"))
    c = cond(emulator, "nogpu", "GpusAvailable")
    assert c["status"] == "False" and "nvidia.com/gpu.product" in c["message"]
    assert "requested but not found: H100" in c["message"]
    assert job_status(emulator, NS, "nogpu")["phase"] == "Pending"
    status = await wait_phase(emulator, "nogpu", "Failed")
    assert "gave up after" in status["message"]


async def test_profiler_failure_is_retried_then_a_timeout_fails_the_job(
        emulator: ApiEmulator, start_operator) -> None:
    start_operator(CEPHALO_PROFILE_TIMEOUT_SECONDS="1.5", CEPHALO_PROFILE_RETRIES="1")
    body = job_body("pf", gpuPools=[{"product": "L4"}])
    await apply_job(emulator, body)
    first = await wait_for("profiler", lambda: pods(emulator, NS, "profiler", "pf"))
    await set_pod(emulator, NS, first[0]["metadata"]["name"], "Failed", exit_code=2,
                  message="NVML: driver mismatch")
    await wait_for("retry pod", lambda: [p for p in pods(emulator, NS, "profiler", "pf")
                                         if p["metadata"]["name"].endswith("-1")])
    warn = await wait_for("ProfilerFailed event", lambda: [
        m for t, r, m in events(emulator, "pf") if r == "ProfilerFailed"])
    assert "NVML: driver mismatch" in warn[0]
    status = await wait_phase(emulator, "pf", "Failed")
    assert "did not finish within" in status["message"] and "L4" in status["message"]
    assert cond(emulator, "pf", "Failed")["reason"] == "ProfilingFailed"
    await wait_for("profilers gone", lambda: pods(emulator, NS, "profiler", "pf") == [])


async def test_job_deleted_mid_profiling_leaves_nothing_behind(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    await apply_job(emulator, job_body("gone"))
    await wait_for("profilers", lambda: len(pods(emulator, NS, "profiler", "gone")) == 4)
    await call(emulator, "DELETE", JOBS.format(ns=NS) + "/gone")
    await wait_for("job removed", lambda: not emulator.list_objects(
        "cephalojobs", NS, group="cephalo.dev"))
    leftovers = [o["metadata"]["name"] for plural in ("pods", "configmaps", "services")
                 for o in emulator.list_objects(plural, NS)]
    assert leftovers == []


async def test_a_bad_setting_stops_the_operator_at_startup_with_one_clear_line(
        emulator: ApiEmulator, tmp_path) -> None:
    """A zero reconcile period would be a busy loop against the API server: the operator
    exits with the setting named (CrashLoopBackOff shows it), before any request."""
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_RECHECK_SECONDS="0").start()
    try:
        await wait_for("the operator to exit",
                       lambda: proc.proc is not None and proc.proc.poll() is not None)
    finally:
        await proc.stop()
    assert proc.proc is not None and proc.proc.returncode != 0
    assert "cephalo operator settings: CEPHALO_RECHECK_SECONDS='0' must be > 0" in proc.log()
    assert emulator.rbac_rules(include_tests=False) == set()  # it touched nothing


async def test_operator_killed_mid_phase_resumes_without_duplicates(
        emulator: ApiEmulator, start_operator) -> None:
    first = start_operator()
    body = job_body("rs", **SMALL)
    await apply_job(emulator, body)
    await wait_for("profilers", lambda: len(pods(emulator, NS, "profiler", "rs")) == 2)
    # A pass creates the profiler pods, then writes Profiling: killed in between, a new
    # operator would find the profiles done and never show the phase (issue 17's flake).
    await wait_phase(emulator, "rs", "Profiling")
    await first.kill()  # mid-Profiling
    await finish_profilers(emulator, NS, body, count=2)
    second = start_operator()
    ranks = await run_ranks(emulator, "rs")
    await wait_phase(emulator, "rs", "Running")
    await second.kill()  # mid-Running
    start_operator()
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
    await wait_phase(emulator, "rs", "Succeeded")
    for plural in ("pods", "configmaps", "services"):
        dup = {k: n for k, n in emulator.created(plural).items() if n > 1}
        assert not dup, f"{plural} created twice: {dup}"
    # A plan with sizes beyond the profiled ones measured them first (a pass per round).
    extra = ["Profiling", "Planning"] * extra_passes_asked(emulator, "rs")["rounds"]
    assert phases(emulator, "rs") == ["Profiling", "Planning", *extra, "Pending", "Running",
                                      "Succeeded"]


async def test_suspend_stops_ranks_and_resume_restarts_them(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("sus", **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    await run_ranks(emulator, "sus")
    await wait_phase(emulator, "sus", "Running")
    url = JOBS.format(ns=NS) + "/sus"
    await call(emulator, "PATCH", url, {"spec": {"suspend": True}})
    await wait_phase(emulator, "sus", "Suspended")
    await wait_for("ranks stopped", lambda: pods(emulator, NS, "trainer", "sus") == [])
    assert cond(emulator, "sus", "Suspended")["status"] == "True"
    await call(emulator, "PATCH", url, {"spec": {"suspend": False}})
    await run_ranks(emulator, "sus")
    await wait_phase(emulator, "sus", "Running")
    assert cond(emulator, "sus", "Suspended")["status"] == "False"
    assert job_status(emulator, NS, "sus")["observedGeneration"] == 3


async def test_ttl_deletes_the_finished_job_and_its_children(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("ttl", ttlSecondsAfterFinished=1, **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    ranks = await run_ranks(emulator, "ttl")
    for pod in ranks:
        await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
    # Not a wait for the Succeeded phase: with a 1 s TTL the job may already be gone when
    # this (loaded) event loop next looks (session 9: 120 s waiting for a phase the job had
    # held for about a second). What it went through is in the emulator's history.
    await wait_for("job deleted", lambda: not emulator.list_objects(
        "cephalojobs", NS, group="cephalo.dev"))
    phases = [(v.get("status") or {}).get("phase")
              for v in emulator.history("cephalojobs", NS, "ttl", group="cephalo.dev")]
    assert "Succeeded" in phases, phases
    assert [p for p in phases if p][-1] == "Succeeded", phases  # deleted once finished
    assert pods(emulator, NS, "trainer") == []
    assert [c["metadata"]["name"] for c in emulator.list_objects("configmaps", NS)
            if c["metadata"]["name"].startswith("ttl-")] == []


async def test_progress_is_scraped_from_rank_0_and_operator_metrics_are_served(
        emulator: ApiEmulator, start_operator) -> None:
    served = {"text": 'cephalo_step{rank="0"} 42\ncephalo_samples_per_second{rank="0"} 123.5\n'
                      'cephalo_loss{rank="0"} 2.5\n'}

    async def metrics_page(_request: web.Request) -> web.Response:
        return web.Response(text=served["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        proc = start_operator(CEPHALO_TRAINER_METRICS_PORT=str(port))
        body = job_body("prog", **SMALL)
        await apply_job(emulator, body)
        await finish_profilers(emulator, NS, body, count=2)
        await run_ranks(emulator, "prog")
        status = await wait_for("progress", lambda: (
            s if (s := job_status(emulator, NS, "prog")).get("progress") else None))
        progress = status["progress"]
        assert progress["step"] == 42 and progress["samplesPerSecond"] == 123.5
        assert progress["loss"] == 2.5 and progress["totalSteps"] == 100
        served["text"] = 'cephalo_step{rank="0"} 43\n'
        await wait_for("step 43", lambda: job_status(
            emulator, NS, "prog")["progress"]["step"] == 43)
        async with ClientSession() as http, http.get(
                f"http://127.0.0.1:{proc.metrics_port}/metrics") as resp:
            text = await resp.text()
    finally:
        await runner.cleanup()
    assert 'cephalo_operator_jobs{phase="Running"} 1.0' in text
    # Planned once, and again after each round of extra profiler passes (sizes beyond the
    # profiled ones); each pass is a profiling of its product.
    extra = extra_passes_asked(emulator, "prog")
    assert f"cephalo_operator_planning_duration_seconds_count {1 + extra['rounds']}.0" in text
    assert 'cephalo_operator_reconciles_total{outcome="ok"}' in text
    job_labels = '{cephalo_job="prog",cephalo_namespace="default"}'  # as on trainer series
    assert f"cephalo_operator_predicted_samples_per_second{job_labels}" in text
    measured = f"cephalo_operator_measured_samples_per_second{job_labels}"
    assert f"{measured} 123.5" in text
    l4 = 1 + len(extra["passes"].get("L4", []))
    assert f'cephalo_operator_profiling_duration_seconds_count{{product="L4"}} {l4}.0' in text


def _rank_0_page(step: int, step_seconds: list[float]) -> str:
    """What a trainer's rank 0 serves (its own TrainerMetrics registry) after `step`, having
    timed one step of each of `step_seconds` (none: a gang that has timed no step yet)."""
    from prometheus_client import generate_latest

    from cephalo.trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics(rank=0, port=0, predicted_step_seconds=1.0)
    # 64 samples at 640 samples/s is 0.1 s a step: an ETA from it would be another one.
    metrics.observe(step=step, loss=2.0, step_seconds=0.1, samples_per_second=640.0,
                    tokens_per_second=1.0, tflops=0.1, wait_seconds_by_op={}, local_rank=0)
    for seconds in step_seconds:
        metrics.time_ranks(seconds, [seconds * 0.75] * 3, [seconds * 0.25] * 3)
    return generate_latest(metrics.registry).decode()


PERCENT = "cephalo_operator_progress_percent"
END = "cephalo_operator_estimated_end_timestamp_seconds"


def _job_sample(text: str, name: str, job: str) -> float | None:
    """The value of the operator's series `name` for `job` in Prometheus text; None if none."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("cephalo_job") == job:
                return float(sample.value)
    return None


def _seconds_to_end(progress: dict) -> float:
    """estimatedEndTime after the scrape that set it (both RFC 3339, whole seconds)."""
    end, scraped = parse_time(progress["estimatedEndTime"]), parse_time(progress["lastUpdateTime"])
    assert end is not None and scraped is not None, progress
    return end - scraped


async def test_progress_percent_and_eta_follow_the_current_gang(
        emulator: ApiEmulator, start_operator) -> None:
    """Issue 46 item 4: status.progress.percent and .estimatedEndTime from rank 0's measured
    step time; after a gang restart the estimate waits for the new gang's own step time (the
    old gang's is not used); Succeeded is 100 % with no estimate. The operator's metrics say
    the same."""
    served = {"text": _rank_0_page(42, [])}

    async def metrics_page(_request: web.Request) -> web.Response:
        return web.Response(text=served["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    def progress_of() -> dict:
        return job_status(emulator, NS, "eta").get("progress") or {}

    async def operator_metric(name: str, until: Callable[[float | None], bool]) -> float | None:
        """The operator's series `name` of this job (None: no series), once `until` holds."""
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            async with ClientSession() as http, http.get(
                    f"http://127.0.0.1:{proc.metrics_port}/metrics") as resp:
                value = _job_sample(await resp.text(), name, "eta")
            if until(value) or time.monotonic() > deadline:
                return value
            await asyncio.sleep(0.05)

    try:
        proc = start_operator(CEPHALO_TRAINER_METRICS_PORT=str(port))
        body = job_body("eta", backoffLimit=2, **SMALL,
                        planner={"chooseGpus": False, "replan": {"enabled": False}})
        await apply_job(emulator, body)
        await finish_profilers(emulator, NS, body, count=2)
        await run_ranks(emulator, "eta")
        # No step timed yet: the share done, no end.
        progress = await wait_for("step 42", lambda: (
            p if (p := progress_of()).get("step") == 42 else None))
        assert progress["percent"] == 42 and "estimatedEndTime" not in progress, progress
        # Ten steps timed at 2 s: 58 steps left end 116 s after the scrape.
        served["text"] = _rank_0_page(42, [1.5, 2.5] * 5)
        progress = await wait_for("an estimated end", lambda: (
            p if "estimatedEndTime" in (p := progress_of()) else None))
        assert progress["percent"] == 42 and _seconds_to_end(progress) == 116, progress
        end = parse_time(progress["estimatedEndTime"])
        assert await operator_metric(PERCENT, lambda v: v == 42) == 42
        assert await operator_metric(END, lambda v: v == end) == end
        # A rank fails: while the gang restarts there is no estimate (no gang is training).
        await set_pod(emulator, NS, "eta-rank-1", "Failed", exit_code=137, message="OOMKilled")
        status = await wait_phase(emulator, "eta", "Restarting")
        assert status["progress"]["percent"] == 42, status["progress"]
        assert "estimatedEndTime" not in status["progress"], status["progress"]
        # The new gang resumes from a checkpoint at step 40. Its rank 0 has timed no step yet,
        # and the gang before it measured 2 s a step: no estimate, not that one.
        served["text"] = _rank_0_page(40, [])
        await run_ranks(emulator, "eta")
        progress = await wait_for("the new gang's step 40", lambda: (
            p if (p := progress_of()).get("step") == 40 else None))
        assert progress["percent"] == 40 and "estimatedEndTime" not in progress, progress
        # The new gang times 3 s a step (another node, say): 60 steps left, 180 s.
        served["text"] = _rank_0_page(40, [3.0] * 4)
        progress = await wait_for("the new gang's estimate", lambda: (
            p if "estimatedEndTime" in (p := progress_of()) else None))
        assert _seconds_to_end(progress) == 180, progress
        for pod in pods(emulator, NS, "trainer", "eta"):
            await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
        status = await wait_phase(emulator, "eta", "Succeeded")
        assert status["progress"]["percent"] == 100, status["progress"]
        assert "estimatedEndTime" not in status["progress"]
        assert await operator_metric(PERCENT, lambda v: v == 100) == 100
        assert await operator_metric(END, lambda v: v is None) is None  # a finished job: none
    finally:
        await runner.cleanup()
    # Only a running gang has an estimate: every status the job went through says so.
    for version in emulator.history("cephalojobs", NS, "eta", group="cephalo.dev"):
        status = version.get("status") or {}
        if status.get("phase") != "Running":
            assert "estimatedEndTime" not in (status.get("progress") or {}), status


async def test_lost_node_replans_on_the_remaining_gpus(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("lost", **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    await run_ranks(emulator, "lost")
    await wait_phase(emulator, "lost", "Running")
    assert job_status(emulator, NS, "lost")["plan"]["pools"] == {"NVIDIA-L4": 2,
                                                                 "NVIDIA-RTX-A6000": 1}
    await call(emulator, "DELETE", "/api/v1/nodes/a-l4")
    await wait_for("a plan without L4", lambda: (p := plan_of(emulator, "lost")) and
                   p.world_size == 1)
    ranks = await run_ranks(emulator, "lost")  # waits for the new plan's pods
    assert [p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for p in ranks] == [
        "NVIDIA-RTX-A6000"]
    status = await wait_phase(emulator, "lost", "Running")
    assert status["plan"]["pools"] == {"NVIDIA-RTX-A6000": 1} and status["plan"]["worldSize"] == 1
    replan = await wait_for("Replanning event", lambda: [
        m for _, r, m in events(emulator, "lost") if r == "Replanning"])
    assert "NVIDIA-L4: plan uses 2, 0 available" in replan[0]


async def test_changing_the_batch_size_replans_and_restarts_the_ranks(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("chg", **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    await run_ranks(emulator, "chg")
    await wait_phase(emulator, "chg", "Running")
    await call(emulator, "PATCH", JOBS.format(ns=NS) + "/chg", {"spec": {"globalBatchSize": 48}})
    await wait_for("new plan", lambda: (p := plan_of(emulator, "chg")) and
                   p.global_batch_size == 48)
    ranks = await run_ranks(emulator, "chg")
    total = sum(int(next(e["value"] for e in p["spec"]["containers"][0]["env"]
                         if e["name"] == "CEPHALO_BATCH_SIZE")) for p in ranks)
    assert total == 48
    status = await wait_phase(emulator, "chg", "Running")
    assert status["observedGeneration"] == 2
    await wait_for("Replanning event", lambda: any(
        r == "Replanning" and "spec changed" in m for _, r, m in events(emulator, "chg")))


async def test_invalid_spec_fails_with_the_field_named(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    # The CRD schema rejects this on a real API server; the operator must not crash on it.
    await apply_job(emulator, job_body("bad", globalBatchSize=0))
    status = await wait_phase(emulator, "bad", "Failed")
    assert "globalBatchSize" in status["message"]
    assert cond(emulator, "bad", "Failed")["reason"] == "InvalidSpec"


async def test_a_rank_pod_deleted_while_running_triggers_a_gang_restart(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("evict", **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    await run_ranks(emulator, "evict")
    await wait_phase(emulator, "evict", "Running")
    await call(emulator, "DELETE", f"/api/v1/namespaces/{NS}/pods/evict-rank-2")
    second = await run_ranks(emulator, "evict")
    assert {p["metadata"]["labels"]["cephalo.dev/attempt"] for p in second} == {"1"}
    status = await wait_phase(emulator, "evict", "Running")
    assert status["restarts"] == 1
    restart = next(m for _, r, m in events(emulator, "evict") if r == "GangRestart")
    # Deleted by someone else: a counted restart (not a disruption: no DisruptionTarget).
    assert "rank 2" in restart and "PodDeleted" in restart
