"""Use Cephalo on a cluster from Python: `CephaloClient` (submit, get, list, watch, wait,
logs, plan_on_cluster, suspend, resume, delete). The `cephalo` commands are a thin layer
over it. Needs the `kubernetes` client (`pip install 'cephalo[client]'`); never torch."""

from cephalo.client.cluster_plan import ClusterPlan, TakenGpus
from cephalo.client.connection import Target
from cephalo.client.core import CephaloClient, validate_job
from cephalo.client.errors import (
    ApiRefused,
    ClientError,
    CrdNotInstalled,
    Forbidden,
    JobFailed,
    JobNotFound,
    KubeconfigError,
    Unreachable,
    WaitTimeout,
)
from cephalo.client.jobs import Job
from cephalo.client.logs import LogLine

__all__ = [
    "ApiRefused", "CephaloClient", "ClientError", "ClusterPlan", "CrdNotInstalled",
    "Forbidden", "Job", "JobFailed", "JobNotFound", "KubeconfigError", "LogLine",
    "TakenGpus", "Target", "Unreachable", "WaitTimeout", "validate_job",
]
