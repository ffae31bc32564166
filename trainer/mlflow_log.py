"""Rank 0's MLflow run (`spec.tracking.mlflow`), logged with MLflow's own client
(`mlflow-skinny`: the `tracking` extra) from a background thread.

One job, one run: every attempt (a gang restart, a rescale, `cephalo run --resume`) finds
the run the first one created and logs on into it: by `mlflow-run.json` next to the progress
file (the run directory, the checkpoint volume's job folder), else by the tag
`cephalo.job_uid` in the experiment (the operator's job.yaml carries the uid).

Tracking never stops or slows training: `write` only appends a record to a bounded queue
(the oldest dropped when full); the thread sends them in batches, every request bounded by
REQUEST_TIMEOUT_SECONDS without retries of MLflow's own; a failure is said once (one line)
and retried after RETRY_AFTER_SECONDS; `close` waits CLOSE_TIMEOUT_SECONDS at most.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import tempfile
import threading
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo.api.job import CephaloJobSpec
from cephalo.api.plan import Plan
from cephalo.api.tracking import MlflowTracking, TrackingSpec

# Bounds on what a down or slow server can cost (see the module docstring).
REQUEST_TIMEOUT_SECONDS = 5
REQUEST_MAX_RETRIES = 0  # ours instead: the batch is kept and tried again later
RETRY_AFTER_SECONDS = 10.0
CLOSE_TIMEOUT_SECONDS = 30.0  # at the job's end, for a slow server: never while training
MAX_QUEUED_RECORDS = 10_000  # ~ 1 MB of records for 8 ranks
METRICS_PER_REQUEST = 1000  # MLflow's log-batch limit
PARAMS_PER_REQUEST = 100  # MLflow's log-batch limit
MAX_RANK_PARAMS = 64  # one param per rank up to this; the plan artifact holds them all
RUN_ID_FILE = "mlflow-run.json"
TAG_JOB_UID = "cephalo.job_uid"
URI_VARIABLE = "MLFLOW_TRACKING_URI"

Sample = tuple[str, float, int, int]  # metric key, value, timestamp in ms, step


@dataclass(frozen=True)
class RunIdentity:
    """Who the run is for: the job's tags and where its run id is remembered."""

    job: str | None = None
    namespace: str | None = None
    uid: str | None = None
    attempt: int = 0
    state_file: Path | None = None  # mlflow-run.json, None without a local folder

    def tags(self) -> dict[str, str]:
        values = {"cephalo.job": self.job, "cephalo.namespace": self.namespace,
                  TAG_JOB_UID: self.uid, "cephalo.attempt": str(self.attempt)}
        return {k: v for k, v in values.items() if v}


def run_params(job: CephaloJobSpec, plan: Plan) -> dict[str, str]:
    """The run's params, logged by the first attempt only (MLflow keeps a param's first
    value: a rescale's new plan goes to its own plan artifact); at most PARAMS_PER_REQUEST."""
    model = job.model
    gpus: dict[str, int] = {}
    for rank in plan.ranks:
        gpus[rank.gpu] = gpus.get(rank.gpu, 0) + 1
    params = {"model": model.preset or model.pretrained or model.family or "custom",
              "global_batch_size": str(job.global_batch_size), "precision": job.precision,
              "steps": str(job.training.steps), "seed": str(job.training.seed),
              "world_size": str(plan.world_size),
              "gpus": ", ".join(f"{n}x {gpu}" for gpu, n in sorted(gpus.items())),
              "predicted_samples_per_second": str(plan.predicted_samples_per_second)}
    for rank in plan.ranks[:MAX_RANK_PARAMS]:
        params[f"plan.rank{rank.rank}"] = (
            f"gpu={rank.gpu} batch={rank.batch_size} micro={rank.micro_batch_size}"
            f"x{rank.num_micro_batches} shard={rank.shard_ratio:.4f}")
    return params


def record_metrics(record: dict[str, Any], predicted: float | None
                   ) -> list[Sample]:
    """(key, value, timestamp ms, step) of one progress record (step_log.progress_record):
    its numbers under their own names, the plan's prediction beside the measured
    samples/s, every rank's compute and wait seconds as rank<N>/..."""
    step, millis = int(record["step"]), int(record["time"] * 1000)
    out = [(key, float(value), millis, step) for key, value in record.items()
           if key not in ("step", "time", "ranks") and isinstance(value, int | float)]
    if predicted:
        out.append(("predicted_samples_per_second", float(predicted), millis, step))
    for timing in record.get("ranks", []):
        for key in ("compute_seconds", "collective_wait_seconds"):
            out.append((f"rank{timing['rank']}/{key}", float(timing[key]), millis, step))
    return out


@dataclass
class _Run:
    """The I/O against the tracking server; used by the background thread only."""

    uri: str
    settings: MlflowTracking
    identity: RunIdentity
    params: dict[str, str]
    plan_json: str
    client: Any = None
    run_id: str | None = None

    def open(self) -> None:
        from mlflow import MlflowClient  # seconds to import: here, not on the training path

        self.client = client = MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.settings.experiment)
        experiment_id = found.experiment_id if found is not None else \
            client.create_experiment(self.settings.experiment)
        run_id = self._existing(experiment_id)
        if run_id is None:
            run = client.create_run(experiment_id, run_name=self.settings.run_name or
                                    self.identity.job, tags=self.identity.tags())
            run_id = run.info.run_id
            if self.identity.state_file is not None:
                # A read-only folder: the uid tag still finds the run (never a second one).
                with contextlib.suppress(OSError):
                    self.identity.state_file.write_text(json.dumps(
                        {"tracking_uri": self.uri, "experiment_id": experiment_id,
                         "run_id": run_id}) + "\n")
        else:
            client.update_run(run_id, status="RUNNING")
        # The first attempt's params, in one request (all or none): a later attempt's plan
        # (a rescale) goes to plans/, beside the first one's per-rank params.
        first = not client.get_run(run_id).data.params
        self._batches(run_id, params=list(self.params.items()) if first else [],
                      tags=list(self.identity.tags().items()))
        self._log_plan(run_id)
        self.run_id = run_id

    def _existing(self, experiment_id: str) -> str | None:
        """The run an earlier attempt created: its id file, else its job uid tag."""
        state = self.identity.state_file
        if state is not None and state.is_file():
            try:
                saved = json.loads(state.read_text())
            except ValueError:
                saved = {}
            if saved.get("tracking_uri") == self.uri and \
                    saved.get("experiment_id") == experiment_id:
                from mlflow.exceptions import MlflowException

                try:
                    run = self.client.get_run(saved["run_id"])
                except MlflowException as err:  # deleted for good: a new run; else retried
                    if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                        raise
                else:
                    if run.info.lifecycle_stage == "active":
                        return str(saved["run_id"])
        uid = self.identity.uid
        if uid and all(c.isalnum() or c == "-" for c in uid):  # a Kubernetes uid
            runs = self.client.search_runs(
                [experiment_id], filter_string=f"tags.`{TAG_JOB_UID}` = '{uid}'",
                order_by=["attributes.start_time ASC"], max_results=1)
            if runs:
                return str(runs[0].info.run_id)
        return None

    def _log_plan(self, run_id: str) -> None:
        """plan.json (this attempt's), and plans/plan-<digest>.json: each distinct plan of the
        run's attempts once (a rescale adds one)."""
        digest = hashlib.sha256(self.plan_json.encode()).hexdigest()[:12]
        with tempfile.TemporaryDirectory(prefix="cephalo-mlflow-") as folder:
            path = Path(folder) / "plan.json"
            path.write_text(self.plan_json)
            self.client.log_artifact(run_id, str(path))
            kept = Path(folder) / f"plan-{digest}.json"
            kept.write_text(self.plan_json)
            self.client.log_artifact(run_id, str(kept), artifact_path="plans")

    def _batches(self, run_id: str, *, metrics: Sequence[Sample] = (),
                 params: Sequence[tuple[str, str]] = (),
                 tags: Sequence[tuple[str, str]] = ()) -> None:
        from mlflow.entities import Metric, Param, RunTag

        if params:
            assert len(params) <= PARAMS_PER_REQUEST  # run_params: 8 + MAX_RANK_PARAMS
            self.client.log_batch(run_id, params=[Param(k, v) for k, v in params])
        if tags:
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags])
        for i in range(0, len(metrics), METRICS_PER_REQUEST):
            self.client.log_batch(run_id, metrics=[
                Metric(k, v, ms, step) for k, v, ms, step in metrics[i:i + METRICS_PER_REQUEST]])

    def send(self, metrics: list[Sample]) -> None:
        if self.run_id is None:
            if self.client is None:
                probe(self.uri)  # before seconds of importing MLflow for a server not there
            self.open()
        assert self.run_id is not None
        self._batches(self.run_id, metrics=metrics)

    def end(self, status: str) -> None:
        assert self.run_id is not None
        self.client.set_terminated(self.run_id, status=status)


class MlflowLog:
    """Rank 0's run: `write(record)` never blocks, `close(status)` waits a bounded time."""

    def __init__(self, run: _Run, predicted: float | None,
                 warn: Callable[[str], None] | None = None) -> None:
        bound_requests()
        self._run = run
        self._predicted = predicted
        self._warn = warn or _warn
        self._queue: deque[list[Sample]] = deque(
            maxlen=MAX_QUEUED_RECORDS)
        self._ready = threading.Condition()
        self._closing: str | None = None  # the run's final status once closing
        self.dropped_records = 0
        self.failures = 0
        self.sent_records = 0
        self._thread = threading.Thread(target=self._loop, name="cephalo-mlflow", daemon=True)
        self._thread.start()

    @property
    def uri(self) -> str:
        return self._run.uri

    def write(self, record: dict[str, Any]) -> None:
        """One progress record (step_log.progress_record); returns at once."""
        metrics = record_metrics(record, self._predicted)
        with self._ready:
            if len(self._queue) == self._queue.maxlen:
                self.dropped_records += 1  # the oldest goes: the newest steps matter most
            self._queue.append(metrics)
            self._ready.notify()

    def close(self, status: str = "FINISHED") -> None:
        """Ends the run (FINISHED, or KILLED for a stop: a later attempt sets it RUNNING
        again) after the queued records, waiting CLOSE_TIMEOUT_SECONDS at most."""
        with self._ready:
            self._closing = status
            self._ready.notify()
        self._thread.join(CLOSE_TIMEOUT_SECONDS)

    def _take(self) -> tuple[list[Sample], int, str | None]:
        """Queued records, up to about one request's worth (waits for one or for close)."""
        with self._ready:
            self._ready.wait_for(lambda: self._queue or self._closing is not None)
            batch: list[Sample] = []
            records = 0
            while self._queue and len(batch) < METRICS_PER_REQUEST:
                batch += self._queue.popleft()
                records += 1
            return batch, records, self._closing if not self._queue else None

    def _loop(self) -> None:
        unsent: tuple[list[Sample], int] | None = None
        while True:
            if unsent is None:
                batch, records, closing = self._take()
            else:
                batch, records = unsent
                with self._ready:
                    closing = self._closing if not self._queue else None
            try:
                if batch or self._run.run_id is None:
                    self._run.send(batch)
                self.sent_records += records
                unsent = None
                if closing is not None:
                    self._run.end(closing)
                    return
            except Exception as err:  # any failure of the tracker's: said once, never raised
                self.failures += 1
                if self.failures == 1:
                    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                    self._warn(f"spec.tracking.mlflow: MLflow at {self._run.uri} failed "
                               f"({first[:300]}); training goes on, records are kept (at "
                               f"most {MAX_QUEUED_RECORDS}) and sent when it answers")
                with self._ready:
                    if self._closing is not None:
                        return  # a server that is down does not hold up the job's end
                unsent = (batch, records)
                with self._ready:  # close() cuts the wait short
                    self._ready.wait_for(lambda: self._closing is not None,
                                         timeout=RETRY_AFTER_SECONDS)


def probe(uri: str) -> None:
    """Raises OSError when nothing answers TCP at an http(s) URI's host and port (within
    REQUEST_TIMEOUT_SECONDS); other URIs (databricks) are left to MLflow's client."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), REQUEST_TIMEOUT_SECONDS).close()
    except OSError as err:
        raise OSError(f"cannot connect to {parts.hostname}:{port}: "
                      f"{err.strerror or err}") from None


def bound_requests() -> None:
    """Every request of MLflow's client in this process: REQUEST_TIMEOUT_SECONDS, no
    retries of its own (its defaults: 120 s and 7 retries with backoff, minutes)."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(REQUEST_TIMEOUT_SECONDS)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(REQUEST_MAX_RETRIES)


def tracking_uri(settings: MlflowTracking, environ: dict[str, str] | None = None
                 ) -> str | None:
    """The job's trackingUri, else MLFLOW_TRACKING_URI (the operator's default)."""
    env = os.environ if environ is None else environ
    return settings.tracking_uri or env.get(URI_VARIABLE) or None


def open_mlflow(tracking: TrackingSpec | None, job: CephaloJobSpec, plan: Plan, rank: int,
                identity: RunIdentity) -> MlflowLog | None:
    """Rank 0's run when the job asks for one and it can be logged, else None (said once)."""
    if rank != 0 or tracking is None or tracking.mlflow is None:
        return None
    uri = tracking_uri(tracking.mlflow)
    if uri is None:
        _warn(f"spec.tracking.mlflow: no tracking server (no trackingUri, no {URI_VARIABLE}, "
              "no tracking.mlflowUri in the operator's chart); training without MLflow")
        return None
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        _warn("spec.tracking.mlflow: the mlflow package is not installed (pip install "
              "'cephalo[tracking]'); training without MLflow")
        return None
    run = _Run(uri=uri, settings=tracking.mlflow, identity=identity,
               params=run_params(job, plan), plan_json=plan.model_dump_json(indent=1))
    return MlflowLog(run, plan.predicted_samples_per_second)


def log_model(run_file: Path, output: Path) -> str:
    """`cephalo export --mlflow`: the exported file or folder as the `model` artifact of the
    run `run_file` (RUN_ID_FILE) names; MLflow's own request bounds (an upload of gigabytes
    is no 5-s request, and the user waits for it)."""
    saved = json.loads(run_file.read_text())
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    if output.is_dir():
        client.log_artifacts(saved["run_id"], str(output), artifact_path="model")
    else:
        client.log_artifact(saved["run_id"], str(output), artifact_path="model")
    return (f"{saved['tracking_uri'].rstrip('/')}/#/experiments/{saved['experiment_id']}/runs/"
            f"{saved['run_id']} (artifact model/{output.name if output.is_file() else ''})")


def _warn(message: str) -> None:
    print(f"cephalo trainer (rank 0): warning: {message}", file=sys.stderr, flush=True)
