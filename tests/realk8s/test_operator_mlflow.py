"""spec.tracking.mlflow under the real control plane (issue 38): a job whose rank 1 is killed
mid-training (a gang restart: new pods, attempt 1) appears in a real MLflow tracking server as
ONE run, found again by the job's uid and mlflow-run.json on the checkpoint claim, with the
params, every step's loss across both attempts, the job's tags and the plan artifact; read
back with MLflow's own client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mlflow_server import running_mlflow_server

from .cluster import Cluster
from .operator_run import JOB_SECONDS, JOBS, Operator, phases_until, tiny_job
from .rest import wait_until

STEPS = 10
# Attempt 0's rank 1 stalls in this step (0-based; the checkpoint at step 3 written before it)
# until the test kills it: the kill lands mid-training on a machine of any speed and load, with
# no steps run only to wait for it (it was 100 steps, a race the steps' length had to win: 66 s
# of a suite run).
STALL_STEP = 4
# Its stall: the trainer's time dilation, sleeping this many times the step's own CPU time
# (milliseconds here: minutes of sleep, far beyond the kill; the collective timeout is 600 s).
STALL_DILATION = "100000"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # No job runner: MLflow 3's server otherwise starts a job runner and two huey consumers
    # (three more processes importing mlflow: seconds of a shared CPU) for GenAI jobs this
    # test never submits.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
            yield uri


def _losses(client: Any, experiment: str) -> list[int]:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found is not None else []
    return [m.step for run in runs for m in client.get_metric_history(run.info.run_id, "loss")]


def test_a_gang_restarted_job_is_one_mlflow_run(cluster: Cluster, operator: Operator,
                                                job_namespace: str, mlflow_server: str) -> None:
    from mlflow import MlflowClient

    ns, name, experiment = job_namespace, "tracked", "realk8s"
    body = tiny_job(name, ns, backoffLimit=3, terminationGracePeriodSeconds=10,
                    tracking={"mlflow": {"trackingUri": mlflow_server,
                                         "experiment": experiment}})
    body["spec"]["training"]["steps"] = STEPS
    # Left before the kill: attempt 1's rank 1 (the same pod name) runs at full speed.
    with cluster.kubelet.pod_env_for([(ns, f"{name}-rank-1")], {
            "CEPHALO_TIME_DILATION": STALL_DILATION,
            "CEPHALO_TIME_DILATION_FROM_STEP": str(STALL_STEP)}):
        created = cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
        client = MlflowClient(tracking_uri=mlflow_server)
        # Rank 0 of attempt 0 has logged steps: kill rank 1 (the whole gang restarts).
        wait_until("attempt 0's steps in MLflow", lambda: _losses(client, experiment),
                   JOB_SECONDS, interval_seconds=0.5)
    assert max(_losses(client, experiment)) <= STALL_STEP  # stalled there: mid-training
    cluster.kubelet.kill(ns, f"{name}-rank-1")
    phases, status = phases_until(cluster, ns, name, created["metadata"]["resourceVersion"],
                                  {"Succeeded", "Failed"}, JOB_SECONDS)
    assert status.get("phase") == "Succeeded", (phases, status, operator.log())
    assert (status.get("restarts") or 0) >= 1, status

    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    uid = created["metadata"]["uid"]
    assert run.data.tags["cephalo.job_uid"] == uid and run.data.tags["cephalo.job"] == name
    assert run.data.tags["cephalo.namespace"] == ns
    assert int(run.data.tags["cephalo.attempt"]) >= 1 and run.info.status == "FINISHED"
    assert run.data.params["global_batch_size"] == "8" and run.data.params["world_size"] == "2"
    steps = sorted(set(_losses(client, experiment)))
    assert steps == list(range(1, STEPS + 1)), steps[:5]  # both attempts, every step
    plan = json.loads(Path(client.download_artifacts(
        run.info.run_id, "plan.json", str(cluster.plane.folder))).read_text())
    assert plan["world_size"] == 2
    state = cluster.kubelet.claim_folder(ns, "ckpt").rglob("mlflow-run.json")
    assert [json.loads(p.read_text())["run_id"] for p in state] == [run.info.run_id]
