"""kopf wiring (thin): one reconcile loop per CephaloJob, woken by its pods and by nodes.

A kopf daemon per job runs `reconcile` whenever something relevant changes (a pod of the
job, any node) or its own timer fires. kopf stops the daemon when the job is deleted and
starts it again for every existing job when the operator restarts, so the loop itself holds
no state that matters: everything is read back from the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from cephalo.api import API_GROUP, API_VERSION, PLURAL
from cephalo.operator import metrics
from cephalo.operator.config import OperatorConfig
from cephalo.operator.kube import AsyncKube, Kube, load_api_client
from cephalo.operator.reconcile import reconcile
from cephalo.operator.render import LABEL_JOB

log = logging.getLogger("cephalo.operator")
# A job with nothing pending (finished, failed, suspended) sleeps until an event wakes it;
# this is only the safety net against a missed event.
IDLE_SECONDS = 600.0
_wakeups: dict[tuple[str, str], asyncio.Event] = {}


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = OperatorConfig.from_env()
    # Keep kopf's bookkeeping in annotations: status belongs to the job (and the CRD schema).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.watching.server_timeout = config.watch_timeout_seconds
    settings.posting.level = logging.WARNING  # our own Events are explicit; no log spam
    memo.config = config
    memo.kube = AsyncKube(Kube(await asyncio.to_thread(load_api_client)))
    metrics.serve(config.metrics_port)
    log.info("cephalo operator started: %s", config)


def _wake(namespace: str | None, name: str | None) -> None:
    if namespace and name and (namespace, name) in _wakeups:
        _wakeups[(namespace, name)].set()


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_timeout=10.0)
async def run_job(meta: kopf.Meta, stopped: kopf.DaemonStopped, memo: kopf.Memo,
                  **_: Any) -> None:
    namespace, name = meta["namespace"], meta["name"]
    wakeup = _wakeups.setdefault((namespace, name), asyncio.Event())
    config: OperatorConfig = memo.config
    try:
        while not stopped:
            wakeup.clear()
            with metrics.RECONCILE_SECONDS.time():
                try:
                    wait_seconds = await reconcile(memo.kube, config, namespace, name)
                    metrics.RECONCILES.labels("ok").inc()
                except Exception:  # keep the loop alive; the next pass retries from scratch
                    log.exception("reconcile of %s/%s failed", namespace, name)
                    metrics.RECONCILES.labels("error").inc()
                    wait_seconds = config.recheck_seconds
            await _sleep(wakeup, stopped, IDLE_SECONDS if wait_seconds is None else wait_seconds)
    finally:
        _wakeups.pop((namespace, name), None)
        metrics.set_phase(namespace, name, None)


async def _sleep(wakeup: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Until woken or `seconds` pass; kopf stops async daemons by cancelling this task."""
    if stopped:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wakeup.wait(), timeout=seconds)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_changed(meta: kopf.Meta, **_: Any) -> None:
    _wake(meta.get("namespace"), (meta.get("labels") or {}).get(LABEL_JOB))


@kopf.on.event("", "v1", "nodes")
async def node_changed(**_: Any) -> None:
    for namespace, name in list(_wakeups):  # pools changed: every job re-checks its plan
        _wake(namespace, name)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def job_changed(meta: kopf.Meta, status: kopf.Status, **_: Any) -> None:
    # Our own status writes leave generation == observedGeneration: no need to wake for them.
    if meta.get("generation") != status.get("observedGeneration") or meta.get(
            "deletionTimestamp"):
        _wake(meta.get("namespace"), meta.get("name"))
