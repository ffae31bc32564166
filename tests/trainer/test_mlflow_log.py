"""Rank 0's MLflow log without a server: what it sends for a progress record, and what a
tracking server that fails costs (nothing blocks, the queue is bounded, one warning)."""

from __future__ import annotations

import threading

import pytest

from cephalo.api.job import CephaloJobSpec, MlflowTracking, TrackingSpec
from cephalo.api.plan import Plan
from cephalo.trainer import mlflow_log
from cephalo.trainer.mlflow_log import MlflowLog, RunIdentity, _Run, open_mlflow, record_metrics

PLAN = Plan.model_validate({
    "global_batch_size": 2, "world_size": 1, "predicted_samples_per_second": 4.0,
    "ranks": [{"rank": 0, "batch_size": 2, "micro_batch_size": 2, "num_micro_batches": 1,
               "shard_ratio": 1.0}]})
JOB = CephaloJobSpec.model_validate({"model": {"preset": "gpt-tiny"}, "globalBatchSize": 2})
RECORD = {"step": 3, "loss": 2.5, "samples_per_second": 10.0, "learning_rate": 1e-3,
          "time": 100.25, "ranks": [{"rank": 0, "compute_seconds": 0.5,
                                     "collective_wait_seconds": 0.1}]}


def test_a_record_becomes_metrics_at_its_step_with_the_prediction_beside_it() -> None:
    assert sorted(record_metrics(RECORD, 4.0)) == sorted([
        ("loss", 2.5, 100250, 3), ("samples_per_second", 10.0, 100250, 3),
        ("learning_rate", 1e-3, 100250, 3), ("predicted_samples_per_second", 4.0, 100250, 3),
        ("rank0/compute_seconds", 0.5, 100250, 3),
        ("rank0/collective_wait_seconds", 0.1, 100250, 3)])


class _Down(_Run):
    """A tracking server that fails every request, slowly: `release` lets it answer."""

    def __init__(self) -> None:
        super().__init__(uri="http://127.0.0.1:9", settings=MlflowTracking(experiment="e"),
                         identity=RunIdentity(), params={}, plan_json="{}")
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def send(self, metrics: list[mlflow_log.Sample]) -> None:
        self.calls += 1
        self.entered.set()
        self.release.wait(timeout=30)
        raise ConnectionError("Connection refused\nsecond line")


def test_a_failing_server_blocks_nothing_drops_the_oldest_and_warns_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlflow_log, "MAX_QUEUED_RECORDS", 5)
    warnings: list[str] = []
    run = _Down()
    log = MlflowLog(run, predicted=None, warn=warnings.append)
    log.write({**RECORD, "step": 0})
    assert run.entered.wait(timeout=30)
    # The thread is stuck in its first request: every write still returns at once, and
    # the queue keeps the newest 5 records.
    for step in range(1, 13):
        log.write({**RECORD, "step": step})
    assert log.dropped_records == 7
    assert [record[0][3] for record in log._queue] == [8, 9, 10, 11, 12]
    run.release.set()
    log.close()  # the failure during close ends the thread: no retry wait
    assert not log._thread.is_alive()
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("spec.tracking.mlflow: MLflow at http://127.0.0.1:9 failed "
                                  "(Connection refused);") and "\n" not in warnings[0]
    assert log.sent_records == 0 and log.failures >= 1


def test_requests_are_bounded_and_nothing_opens_without_a_server_or_off_rank_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    mlflow_log.bound_requests()
    import os
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == str(mlflow_log.REQUEST_TIMEOUT_SECONDS)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracked = TrackingSpec(mlflow=MlflowTracking(experiment="e"))
    assert open_mlflow(None, JOB, PLAN, 0, RunIdentity()) is None
    assert open_mlflow(tracked, JOB, PLAN, 1, RunIdentity()) is None
    assert capsys.readouterr().err == ""
    assert open_mlflow(tracked, JOB, PLAN, 0, RunIdentity()) is None  # no server: said once
    assert "spec.tracking.mlflow: no tracking server" in capsys.readouterr().err
    assert mlflow_log.tracking_uri(MlflowTracking(experiment="e"),
                                   {"MLFLOW_TRACKING_URI": "http://x:1"}) == "http://x:1"
    assert mlflow_log.tracking_uri(MlflowTracking(experiment="e", trackingUri="http://y:2"),
                                   {"MLFLOW_TRACKING_URI": "http://x:1"}) == "http://y:2"


def test_params_hold_the_plan_per_rank() -> None:
    params = mlflow_log.run_params(JOB, PLAN)
    assert params["plan.rank0"] == "gpu=cpu batch=2 micro=2x1 shard=1.0000"
    assert params["gpus"] == "1x cpu" and params["model"] == "gpt-tiny"
    assert params["global_batch_size"] == "2" and params["precision"] == "fp32"
    # A thousand ranks: the first MAX_RANK_PARAMS as params, all of them in one request.
    big = Plan.model_validate({"global_batch_size": 1000, "world_size": 1000, "ranks": [
        {"rank": i, "batch_size": 1, "micro_batch_size": 1, "num_micro_batches": 1,
         "shard_ratio": 0.001} for i in range(1000)]})
    many = mlflow_log.run_params(JOB, big)
    assert len(many) <= mlflow_log.PARAMS_PER_REQUEST and "plan.rank63" in many
    assert "plan.rank64" not in many
