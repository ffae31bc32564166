"""spec.tracking.mlflow against a real MLflow tracking server (issue 38): `mlflow server` with
a SQLite store on loopback, read back with MLflow's own MlflowClient. A run stopped and
resumed (`cephalo run --resume`) is one MLflow run with every step's metrics; a tracking
server that is not there costs the run one warning line and nothing else."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mlflow_server import running_mlflow_server
from tests.ports import free_listen_ports

from .cli_helpers import run_cephalo, run_cephalo_in_process, run_without_module

pytestmark = pytest.mark.slow

PLAN = {"global_batch_size": 6, "world_size": 2, "predicted_step_seconds": 0.5,
        "predicted_samples_per_second": 12.0,
        "ranks": [{"rank": i, "batch_size": 3, "micro_batch_size": 3, "num_micro_batches": 1,
                   "shard_ratio": 0.5} for i in range(2)]}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def _job(tiny_job, tracking: str) -> Path:
    job = tiny_job(steps=4)
    job.write_text(job.read_text() + f"  tracking: {{mlflow: {tracking}}}\n")
    return job


def test_a_stopped_and_resumed_run_is_one_mlflow_run_with_every_step(
        tmp_path: Path, tiny_job, mlflow_server: str) -> None:
    from mlflow import MlflowClient

    job = _job(tiny_job, f"{{trackingUri: '{mlflow_server}', experiment: cephalo-tests}}")
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    args = ("run", str(job), "--devices", "cpu:2", "--plan", "plan.json")
    first = run_cephalo(tmp_path, *args, "--stop-after-step", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    resumed = run_cephalo(tmp_path, *args, "--resume", "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "MLflow at" not in (run_dir / "logs" / "rank-1.log").read_text()  # rank 0 only

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("cephalo-tests")
    (run,) = client.search_runs([experiment.experiment_id])  # one run for both launches
    assert (f"mlflow      {mlflow_server}/#/experiments/{experiment.experiment_id}/runs/"
            f"{run.info.run_id}") in resumed.stdout
    assert json.loads((run_dir / "mlflow-run.json").read_text())["run_id"] == run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert run.data.tags["cephalo.job"] == "tiny"
    assert run.data.params["global_batch_size"] == "6"
    assert run.data.params["precision"] == "fp32" and run.data.params["model"] == "gpt-tiny"
    assert run.data.params["gpus"] == "2x cpu" and run.data.params["world_size"] == "2"
    assert run.data.params["plan.rank1"] == "gpu=cpu batch=3 micro=3x1 shard=0.5000"

    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                  key=lambda m: (m.step, m.timestamp))]

    for key in ("loss", "learning_rate", "samples_per_second", "step_seconds"):
        assert history(key) == [(r["step"], pytest.approx(r[key], rel=1e-9)) for r in records]
    assert history("predicted_samples_per_second") == [(s, 12.0) for s in (1, 2, 3, 4)]
    for rank in (0, 1):
        assert history(f"rank{rank}/compute_seconds") == [
            (r["step"], pytest.approx(r["ranks"][rank]["compute_seconds"], rel=1e-9))
            for r in records]
    plan_file = client.download_artifacts(run.info.run_id, "plan.json", str(tmp_path))
    assert json.loads(Path(plan_file).read_text()) == json.loads(
        (run_dir / "plan.json").read_text())
    # The same plan both times: kept once under plans/.
    assert len(client.list_artifacts(run.info.run_id, "plans")) == 1
    # The job's export, logged to the same run.
    exported = run_cephalo(tmp_path, "export", str(run_dir / "checkpoints"), "--output",
                           str(tmp_path / "model.pt"), "--mlflow")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    model = client.download_artifacts(run.info.run_id, "model/model.pt", str(tmp_path / "dl"))
    assert Path(model).read_bytes() == (tmp_path / "model.pt").read_bytes()


def test_a_tracking_server_that_is_down_costs_one_warning_line(tmp_path: Path,
                                                               tiny_job) -> None:
    from cephalo.trainer import mlflow_log

    # What a server that is down can cost the ranks' end at most (training itself never
    # waits on it: records go to a bounded queue): one bounded request, no retries.
    assert mlflow_log.REQUEST_TIMEOUT_SECONDS <= 5 and mlflow_log.REQUEST_MAX_RETRIES == 0
    assert mlflow_log.CLOSE_TIMEOUT_SECONDS <= 30
    closed = free_listen_ports(1)  # nothing listens there
    job = _job(tiny_job, f"{{trackingUri: 'http://127.0.0.1:{closed}', experiment: e}}")
    # One rank: only rank 0 talks to MLflow (the test above shows rank 1 never does), and
    # each rank more is a process that imports torch (~3 s of CPU).
    (tmp_path / "plan.json").write_text(json.dumps({**PLAN, "world_size": 1, "ranks": [
        {"rank": 0, "batch_size": 6, "micro_batch_size": 6, "num_micro_batches": 1,
         "shard_ratio": 1.0}]}))
    done = run_cephalo(tmp_path, "run", str(job), "--devices", "cpu:1", "--plan", "plan.json")
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4
    log = (run_dir / "logs" / "rank-0.log").read_text()
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1, log
    assert f"MLflow at http://127.0.0.1:{closed} failed" in warnings[0]
    assert not (run_dir / "mlflow-run.json").exists()
    # No run was ever created: `cephalo export --mlflow` says so before exporting anything
    # (main() in this process: the real export process's refusals are test_bad_input's).
    exported = run_cephalo_in_process(tmp_path, "export", str(run_dir / "checkpoints"),
                                      "--output", str(tmp_path / "model.pt"), "--mlflow")
    assert exported.returncode == 2, exported.stdout + exported.stderr
    assert "--mlflow: no mlflow-run.json beside" in exported.stderr
    assert not (tmp_path / "model.pt").exists()


def test_mlflow_without_a_tracking_server_is_refused_before_anything_starts(
        tmp_path: Path, tiny_job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    done = run_cephalo(tmp_path, "run", str(_job(tiny_job, "{experiment: e}")), "--devices",
                       "cpu:2")  # named: finding the default devices imports torch (~2 s)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "spec.tracking.mlflow: no tracking server: set tracking.mlflow.trackingUri" \
        in done.stderr
    assert not list(tmp_path.glob("runs/tiny/*/logs/rank-*.log"))


def test_an_attempt_without_a_local_folder_finds_the_run_by_the_job_uid(
        mlflow_server: str) -> None:
    """Checkpoints on object storage (no mlflow-run.json): a gang restart that also rescales
    finds the job's run by its cephalo.job_uid tag; the first attempt's params stay (MLflow
    keeps a param's first value; no plan.rank2 beside them), the new plan is a second plans/
    artifact, the attempt tag moves."""
    from mlflow import MlflowClient

    from cephalo.api.job import CephaloJobSpec, MlflowTracking
    from cephalo.api.plan import Plan
    from cephalo.trainer.mlflow_log import MlflowLog, RunIdentity, _Run, run_params

    job = CephaloJobSpec.model_validate({"model": {"preset": "gpt-tiny"}, "globalBatchSize": 6})
    settings = MlflowTracking(experiment="cephalo-uid", runName="gpt")
    uid = "0d5c2b1e-0000-4000-8000-000000000042"
    for attempt, world in ((0, 2), (1, 3)):  # the restart rescaled 2 ranks to 3
        plan = Plan.model_validate({**PLAN, "world_size": world, "ranks": [
            {"rank": i, "batch_size": 6 // world, "micro_batch_size": 6 // world,
             "num_micro_batches": 1, "shard_ratio": 1 / world} for i in range(world)]})
        identity = RunIdentity(job="gpt", namespace="team-a", uid=uid, attempt=attempt)
        log = MlflowLog(_Run(uri=mlflow_server, settings=settings, identity=identity,
                             params=run_params(job, plan), plan_json=plan.model_dump_json()),
                        predicted=None)
        log.write({"step": attempt + 1, "time": 1000.0 + attempt, "loss": 3.0 - attempt})
        log.close("FINISHED" if attempt else "KILLED")
        assert log.failures == 0 and log.sent_records == 1

    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("cephalo-uid").experiment_id])
    assert run.info.run_name == "gpt" and run.info.status == "FINISHED"
    assert {k: run.data.tags[k] for k in ("cephalo.job", "cephalo.namespace", "cephalo.job_uid",
                                          "cephalo.attempt")} == {
        "cephalo.job": "gpt", "cephalo.namespace": "team-a", "cephalo.job_uid": uid,
        "cephalo.attempt": "1"}
    assert run.data.params["world_size"] == "2" and "plan.rank2" not in run.data.params
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == \
        [(1, 3.0), (2, 2.0)]
    plans = client.list_artifacts(run.info.run_id, "plans")
    assert len(plans) == 2


def test_mlflow_without_the_package_is_refused_before_anything_starts(tmp_path: Path,
                                                                     tiny_job) -> None:
    job = _job(tiny_job, "{trackingUri: 'http://127.0.0.1:5000', experiment: e}")
    done = run_without_module(tmp_path, "mlflow", job)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "spec.tracking.mlflow: the mlflow package is not installed here" in done.stderr


def test_an_id_file_naming_a_deleted_or_unknown_run_starts_a_new_run(
        tmp_path: Path, mlflow_server: str) -> None:
    from mlflow import MlflowClient

    from cephalo.api.job import MlflowTracking
    from cephalo.trainer.mlflow_log import MlflowLog, RunIdentity, _Run

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.create_experiment("cephalo-ids")
    deleted = client.create_run(experiment).info.run_id
    client.delete_run(deleted)
    state = tmp_path / "mlflow-run.json"
    for gone in (deleted, "0" * 32):  # in the trash; never there
        state.write_text(json.dumps({"tracking_uri": mlflow_server,
                                     "experiment_id": experiment, "run_id": gone}))
        log = MlflowLog(_Run(uri=mlflow_server, settings=MlflowTracking(experiment="cephalo-ids"),
                             identity=RunIdentity(job="j", state_file=state), params={},
                             plan_json="{}"), predicted=None)
        log.write({"step": 1, "time": 1.0, "loss": 1.0})
        log.close()
        assert log.failures == 0
        new = json.loads(state.read_text())["run_id"]
        assert new != gone and client.get_run(new).data.metrics == {"loss": 1.0}
