"""spec.tracking of a CephaloJob: experiment tracking, opt-in per job (issue 38;
docs/monitoring.md): TensorBoard event files and an MLflow tracking server, both written by
rank 0 (cephalo.trainer.tensorboard_log, cephalo.trainer.mlflow_log)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from cephalo.api.wire import CamelModel

# An http(s) URL or a Databricks workspace: what a remote MLflow tracking server is reached
# by (a local file store would be on one pod's disk, seen by nobody). No user:password@ in
# it: credentials come from a Secret, never from the spec everyone can read.
MLFLOW_URI_PATTERN = r"^(https?://[^\s/@]+(/[^\s]*)?|databricks(://[^\s/@]*)?)$"
# MLflow's own limits: experiment names 500 characters, run names 250, tag values 8000.
MLFLOW_NAME_PATTERN = r"^[^\x00-\x1f]+$"


class MlflowTracking(CamelModel):
    """Rank 0 logs the job to an MLflow tracking server (cephalo.trainer.mlflow_log)."""

    tracking_uri: str | None = Field(default=None, max_length=1024, json_schema_extra={
        "pattern": MLFLOW_URI_PATTERN}, description=(
        "The tracking server, e.g. http://mlflow.mlflow.svc:5000 (or databricks); default: "
        "the operator's tracking.mlflowUri, else MLFLOW_TRACKING_URI in the trainer's "
        "environment. Credentials never go here: give MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, as env from a Secret "
        "(podTemplate.env valueFrom.secretKeyRef) or in the environment of `cephalo run`."))
    experiment: str = Field(min_length=1, max_length=500, json_schema_extra={
        "pattern": MLFLOW_NAME_PATTERN}, description=(
        "MLflow experiment the run goes into (created when missing); at most 500 "
        "characters."))
    run_name: str | None = Field(default=None, min_length=1, max_length=250,
                                 json_schema_extra={"pattern": MLFLOW_NAME_PATTERN},
                                 description=(
        "The MLflow run's name (at most 250 characters); default: the job's name. Every "
        "attempt of the job (gang restart, rescale, resume) logs to the same run."))

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, uri: str | None) -> str | None:
        if uri is not None and not re.fullmatch(MLFLOW_URI_PATTERN, uri):
            raise ValueError("tracking.mlflow.trackingUri must be an http(s) URL of a "
                             "tracking server (e.g. http://mlflow:5000) or databricks, "
                             "without user:password@ (credentials go in a Secret, as "
                             "MLFLOW_TRACKING_USERNAME/PASSWORD env)")
        return uri

    @field_validator("experiment", "run_name")
    @classmethod
    def _name(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(MLFLOW_NAME_PATTERN, name):
            raise ValueError(f"{name[:80]!r} holds a control character (newline, tab, ...)")
        return name


class TrackingSpec(CamelModel):
    """Experiment tracking, opt-in per job."""

    tensorboard: bool = Field(default=False, description=(
        "Rank 0 writes TensorBoard event files (loss, validation loss, learning rate, grad "
        "norm, measured and predicted samples/s, step time, per-rank compute and wait; the "
        "plan as text) into tensorboard/ next to the progress file: the run directory of "
        "`cephalo run`, the checkpoint volume's job folder on a cluster (none with checkpoints "
        "on object storage). Needs the tensorboard package in the trainer's environment."))
    mlflow: MlflowTracking | None = Field(default=None, description=(
        "Rank 0 logs the run to an MLflow tracking server: params (model, global batch, "
        "precision, GPUs, the plan per rank), per-step metrics (loss, learning rate, "
        "measured and predicted samples/s, per-rank compute and wait), tags (job, "
        "namespace, uid, attempt) and plan.json; restarts and resumes continue the same "
        "run. In the background: a tracking server that is down never stops or slows "
        "training. Needs mlflow-skinny in the trainer's environment (cephalo[tracking])."))


__all__ = ["MLFLOW_NAME_PATTERN", "MLFLOW_URI_PATTERN", "MlflowTracking", "TrackingSpec"]
