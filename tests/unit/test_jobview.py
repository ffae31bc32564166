"""The cluster commands' text (pure): the jobs table, progress line and ETA, ages."""

from __future__ import annotations

import datetime

from cephalo.client.jobs import job_from
from cephalo.commands.jobview import (
    age,
    duration,
    eta_seconds,
    job_details,
    jobs_table,
    progress_text,
)

NOW = datetime.datetime(2026, 12, 2, 12, 0, 0, tzinfo=datetime.timezone.utc)


def _job(name: str = "gpt", **status: object) -> dict:
    return {"metadata": {"name": name, "namespace": "team-a", "uid": "u1",
                         "resourceVersion": "7", "creationTimestamp": "2026-12-02T11:48:00Z"},
            "spec": {"model": {"preset": "gpt-small"}, "globalBatchSize": 64,
                     "training": {"steps": 1000}},
            "status": status}


def test_progress_line_shows_the_operators_percent_and_estimated_end() -> None:
    """Issue 46 item 4: the share done and the end are the operator's (status.progress.percent
    and .estimatedEndTime, from the current gang's measured step time), not a second estimate
    from the last samples/s (which a restarted gang has not measured yet)."""
    job = job_from(_job(phase="Running", progress={
        "step": 400, "loss": 3.25, "samplesPerSecond": 128.0, "percent": 40,
        "estimatedEndTime": "2026-12-02T12:05:00Z"},
        plan={"worldSize": 3, "predictedSamplesPerSecond": 140.0,
              "pools": {"NVIDIA-L4": 2, "Tesla-P40": 1}}))
    assert eta_seconds(job, NOW) == 300.0
    assert progress_text(job, bar=False, now=NOW) == (
        "Running  step 400/1000 (40%)  loss 3.2500  samples/s 128.0 (predicted 140.0)  ETA 5m00s")
    assert progress_text(job, bar=True, now=NOW).startswith(
        "Running  [█████████░░░░░░░░░░░░░░░]  step")
    table = jobs_table([job], NOW).splitlines()
    assert table[0].split()[3:6] == ["STEP", "PROGRESS", "ETA"]
    assert table[1].split() == ["gpt", "Running", "2xNVIDIA-L4,1xTesla-P40", "400/1000", "40%",
                                "5m00s", "3.2500", "128.0/140.0", "0/0", "12m"]
    details = job_details(job, None, [], NOW).splitlines()
    assert "Step:        400/1000 (40%)   loss 3.2500   samples/s measured/predicted " \
        "128.0/140.0" in details
    assert "ETA:         2026-12-02T12:05:00Z (in 5m00s)" in details
    # Past the estimate (a slow last step): due now, never a negative time.
    late = NOW + datetime.timedelta(seconds=400)
    assert eta_seconds(job, late) == 0.0 and progress_text(job, False, late).endswith("ETA 0s")


def test_no_estimated_end_reads_as_a_dash_and_says_why() -> None:
    restarted = job_from(_job(phase="Running", progress={
        "step": 400, "percent": 40, "samplesPerSecond": 128.0}))
    assert eta_seconds(restarted, NOW) is None  # samples/s alone is no estimate
    assert progress_text(restarted, bar=False, now=NOW).endswith("ETA -")
    assert "ETA:         - (no step timed yet by this gang)" in job_details(
        restarted, None, [], NOW).splitlines()
    # A status from an operator without percent: the share is the step over the total.
    older = job_from(_job(phase="Running", progress={"step": 250}))
    assert "step 250/1000 (25%)" in progress_text(older, bar=False, now=NOW)
    done = job_from(_job(phase="Succeeded", progress={"step": 1000, "percent": 100}))
    assert jobs_table([done], NOW).splitlines()[1].split()[3:6] == ["1000/1000", "100%", "-"]
    assert not [line for line in job_details(done, None, [], NOW).splitlines()
                if line.startswith("ETA:")]


def test_a_job_without_progress_or_status_reads_as_pending_with_dashes() -> None:
    job = job_from(_job())
    assert job.phase == "Pending" and eta_seconds(job, NOW) is None
    assert progress_text(job, bar=False, now=NOW) == "Pending  no step yet"
    planned = job_from(_job(phase="Running", plan={
        "worldSize": 1, "predictedSamplesPerSecond": 8352.3, "pools": {"NVIDIA-L4": 1}}))
    # The README walk's first `cephalo watch` line read "loss -  samples/s -  ETA -".
    assert progress_text(planned, bar=True, now=NOW) == \
        "Running  no step yet  (predicted 8352.3 samples/s)"
    assert jobs_table([job], NOW, namespaces=True).splitlines()[1].split() == [
        "team-a", "gpt", "Pending", "-", "-/1000", "-", "-", "-", "-/-", "0/0", "12m"]


def test_an_invalid_spec_on_the_server_is_kept_with_its_reason() -> None:
    body = _job(phase="Failed", message="spec.globalBatchSize: too big",
                conditions=[{"type": "Failed", "status": "True", "reason": "InvalidSpec"}])
    body["spec"]["globalBatchSize"] = 0
    job = job_from(body)
    assert job.spec is None and "globalBatchSize" in (job.spec_error or "")
    assert job.failure_reason == "InvalidSpec: spec.globalBatchSize: too big"


def test_ages_and_durations() -> None:
    assert [age(NOW - datetime.timedelta(seconds=s), NOW) for s in (5, 61, 7200, 90000)] == [
        "5s", "1m", "2h", "1d"]
    assert [duration(s) for s in (None, 0.4, 59.6, 61, 3725)] == [
        "-", "0s", "1m00s", "1m01s", "1h02m"]


def test_cephalo_status_explains_the_last_rescale_decision_in_two_lines() -> None:
    from cephalo.commands.jobview import elastic_lines, job_details

    body = _job(phase="Running", elastic={
        "rescales": 1, "restartSeconds": [20.4, 12.0], "lastDecision": {
            "time": "2026-12-02T11:59:00Z", "verdict": "Skip", "reasonCode": "Cooldown",
            "freeGpus": {"NVIDIA-A10G": 8}, "reason": "4 -> 8 GPUs: predicted 100.0 -> "
            "190.0 samples/s (+90%), saving 300.0 s, but the last rescale was 60 s ago "
            "(cooldown 300 s)"}})
    body["spec"]["elastic"] = {"enabled": True, "minGain": 0.2}
    lines = elastic_lines(job_from(body))
    assert lines == [
        "Elastic:     on (minGain 20%, cooldown 300 s, maxGpus -); 1 rescale(s), restart "
        "measured 20.4 s",
        "  2026-12-02T11:59:00Z not rescaled (Cooldown); could use NVIDIA-A10G x8: 4 -> 8 "
        "GPUs: predicted 100.0 -> 190.0 samples/s (+90%), saving 300.0 s, but the last "
        "rescale was 60 s ago (cooldown 300 s)"]
    assert lines[0] in job_details(job_from(body), None, [], NOW).splitlines()
    fresh = _job(phase="Running")
    fresh["spec"]["elastic"] = {"enabled": True}
    assert elastic_lines(job_from(fresh)) == [
        "Elastic:     on (minGain 10%, cooldown 300 s, maxGpus -); 0 rescale(s), restart "
        "assumed 120 s"]
    assert elastic_lines(job_from(_job(phase="Running"))) == []  # not elastic: nothing


def test_cephalo_status_counts_rolled_back_rescales() -> None:
    from cephalo.commands.jobview import elastic_lines

    body = _job(phase="Running", elastic={"rescales": 1, "rollbacks": 1, "lastDecision": {
        "time": "2026-12-02T11:59:00Z", "verdict": "Skip", "reasonCode": "NotAdmitted",
        "freeGpus": {"NVIDIA-A10G": 8}, "reason": "the 8-GPU gang was not scheduled 300 s "
        "after its pods were created (rescaleTimeoutSeconds 300): …; back to NVIDIA-A10G x4"}})
    body["spec"]["elastic"] = {"enabled": True}
    first, second = elastic_lines(job_from(body))
    assert first == ("Elastic:     on (minGain 10%, cooldown 300 s, maxGpus -); 1 rescale(s) "
                     "(1 rolled back: not admitted), restart assumed 120 s")
    assert second.startswith("  2026-12-02T11:59:00Z not rescaled (NotAdmitted); could use "
                             "NVIDIA-A10G x8: the 8-GPU gang was not scheduled")


def test_cephalo_status_says_a_freed_pool_is_profiled_and_a_failed_one_left_out() -> None:
    from cephalo.commands.jobview import elastic_lines

    body = _job(phase="Running", elastic={
        "lastDecision": {"time": "2026-12-04T11:05:20Z", "verdict": "Skip",
                         "reasonCode": "Profiling", "freeGpus": {"NVIDIA-A10G": 4,
                                                                 "Tesla-T4": 4},
                         "reason": "profiling Tesla-T4 before deciding"},
        "profileFailures": {"NVIDIA-L4": {"failures": 2, "retryTime": "2026-12-04T11:25:20Z",
                                          "reason": "profiler pod x failed"}}})
    body["spec"]["elastic"] = {"enabled": True}
    assert elastic_lines(job_from(body))[1:] == [
        "  2026-12-04T11:05:20Z not decided yet; could use NVIDIA-A10G x4, Tesla-T4 x4: "
        "profiling Tesla-T4 before deciding",
        "  profiling NVIDIA-L4 failed 2 time(s) in a row; left out until 2026-12-04T11:25:20Z: "
        "profiler pod x failed"]


def test_cephalo_status_shows_the_last_calibration() -> None:
    from cephalo.commands.jobview import job_details, replan_lines

    assert replan_lines(job_from(_job(phase="Running"))) == []  # nothing calibrated yet
    body = _job(phase="Running", replan={"replans": 1, "lastCalibration": {
        "time": "2026-12-02T11:59:00Z", "step": 4, "measuredStepSeconds": 0.447,
        "predictedStepSeconds": 0.176, "verdict": "Replan", "reasonCode": "Replanned",
        "reason": "2 -> 1 GPUs"}})
    lines = replan_lines(job_from(body))
    assert lines == [
        "Re-plan:     on (minGain 10%, after 5 timed steps); 1 re-plan(s)",
        "  2026-12-02T11:59:00Z step 4: measured 0.447 s/step, predicted 0.176; re-planned: "
        "2 -> 1 GPUs"]
    assert lines[0] in job_details(job_from(body), None, [], NOW).splitlines()


def test_cephalo_status_shows_the_split_in_force() -> None:
    from cephalo.commands.jobview import job_details, rebalance_lines

    assert rebalance_lines(job_from(_job(phase="Running")), None) == []  # no split shown yet
    body = _job(phase="Running", rebalance={
        "batchSizes": [34, 6], "microBatches": [5, 1], "changes": 1, "lastChangeStep": 10,
        "lastChangeTime": "2026-12-06T15:00:00Z", "lastChangeReason": "split [32, 8] -> [34, 6]"})
    body["spec"]["planner"] = {"rebalance": {"enabled": True}}
    lines = rebalance_lines(job_from(body), None)
    assert lines == [
        "Rebalance:   on (every 10 steps, minGain 5%); split [34, 6], microbatches [5, 1]; "
        "1 change(s) without a restart",
        "  2026-12-06T15:00:00Z after step 10: split [32, 8] -> [34, 6]"]
    assert lines[0] in job_details(job_from(body), None, [], NOW).splitlines()
    body["status"]["rebalance"].update(heldStep=20, heldReason="rank 0 would need 38 samples")
    assert rebalance_lines(job_from(body), None)[-1] == (
        "  held by memory since step 20: rank 0 would need 38 samples (a smaller microbatch "
        "or shard needs a restart: re-planning)")


def test_cephalo_status_names_a_hybrid_plans_replica_groups() -> None:
    """Issue 44: the groups from status.plan, even where the plan ConfigMap is not readable;
    a flat plan shows no sharding line."""
    hybrid = job_from(_job(phase="Running", plan={
        "worldSize": 4, "pools": {"NVIDIA-A10G": 4}, "replicaGroups": 2,
        "replicaGroupSize": 2}))
    details = job_details(hybrid, None, [], NOW).splitlines()
    assert "Sharding:    hybrid, 2 replica groups of 2 ranks (each holds the weights; " \
        "the optimizer state is split across them)" in details
    kept = job_from(_job(phase="Running", plan={
        "worldSize": 4, "pools": {"NVIDIA-A10G": 4}, "replicaGroups": 2,
        "replicaGroupSize": 2, "replicatedFraction": 0.25}))
    assert "Sharding:    hybrid, 2 replica groups of 2 ranks (each holds the weights; 25 % of " \
        "the optimizer state kept in every group, the rest split across them)" in \
        job_details(kept, None, [], NOW).splitlines()
    flat = job_from(_job(phase="Running", plan={"worldSize": 4, "pools": {"NVIDIA-A10G": 4}}))
    assert not any(line.startswith("Sharding:") for line in
                   job_details(flat, None, [], NOW).splitlines())
