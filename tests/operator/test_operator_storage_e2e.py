"""End to end (the real kopf operator over HTTP, issue 13): a multi-rank job without a shared
checkpoint target is refused before any pod exists; a single rank says its checkpoints
are not durable; object storage and the token-file volume reach the rank pods."""

from __future__ import annotations

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import OperatorProcess, apply_job, finish_profilers, pods, wait_for
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    SMALL,
    cond,
    events,
    operator_fixture,
    plan_of,
    run_ranks,
    start_operator_fixture,
    wait_phase,
)

pytestmark = pytest.mark.asyncio
ONE_GPU = {"gpuPools": [{"product": "RTX-A6000"}]}  # cluster A has one: a single-rank plan


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


async def test_multi_rank_job_without_checkpoint_target_is_refused_before_any_pod(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    """Regression (issue 13): every rank got its own emptyDir and ranks >= 1 crashed at the
    first checkpoint, gang restart after gang restart. Now the job fails at once, before
    profiling, with what to set."""
    body = job_body("noshare", checkpoint={"intervalSteps": 10}, **SMALL)
    await apply_job(emulator, body)
    status = await wait_phase(emulator, "noshare", "Failed")
    failed = cond(emulator, "noshare", "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "set spec.checkpoint.claimName (a ReadWriteMany PVC)" in status["message"]
    assert "spec.checkpoint.ephemeral: true" in status["message"]
    assert pods(emulator, NS, "trainer", "noshare") == []
    assert not any(name.startswith("noshare-") for _, name in emulator.created("pods"))
    assert (NS, "noshare-plan") not in emulator.created("configmaps")
    await wait_for("InvalidSpec event", lambda: any(
        r == "InvalidSpec" for _, r, _ in events(emulator, "noshare")))


async def test_single_rank_job_says_its_checkpoints_are_not_durable(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("solo", checkpoint={"intervalSteps": 10}, **ONE_GPU)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=1)
    (rank,) = await run_ranks(emulator, "solo")
    assert {"name": "checkpoints", "emptyDir": {}} in rank["spec"]["volumes"]
    await wait_phase(emulator, "solo", "Running")
    durable = cond(emulator, "solo", "CheckpointsDurable")
    assert durable["status"] == "False" and durable["reason"] == "EmptyDir"
    assert "will not survive a restart" in durable["message"]
    await wait_for("warning", lambda: any(
        t == "Warning" and r == "CheckpointsNotDurable" for t, r, _ in events(emulator, "solo")))


async def test_object_storage_and_token_volume_reach_the_rank_pods(
        emulator: ApiEmulator, operator: OperatorProcess) -> None:
    body = job_body("s3", checkpoint={"uri": "s3://bucket/runs/"},
                    data={"tokenFile": {"path": "/data/t.bin", "claimName": "datasets"}},
                    podTemplate={"envFrom": [{"secretRef": {"name": "s3-credentials"}}]},
                    **SMALL)
    await apply_job(emulator, body)
    await finish_profilers(emulator, NS, body, count=2)
    ranks = await run_ranks(emulator, "s3")
    assert len(ranks) == plan_of(emulator, "s3").world_size > 1
    for pod in ranks:
        assert _env(pod)["CEPHALO_CHECKPOINT_DIR"] == f"s3://bucket/runs/{NS}/s3"
        assert pod["spec"]["containers"][0]["envFrom"] == [
            {"secretRef": {"name": "s3-credentials"}}]
        assert {"name": "dataset", "persistentVolumeClaim": {
            "claimName": "datasets", "readOnly": True}} in pod["spec"]["volumes"]
    await wait_phase(emulator, "s3", "Running")
    durable = cond(emulator, "s3", "CheckpointsDurable")
    assert durable["status"] == "True" and durable["reason"] == "ObjectStorage"
