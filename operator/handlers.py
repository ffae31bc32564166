"""kopf wiring (thin): one reconcile loop per CephaloJob, woken by its pods and by nodes.

A kopf daemon per job runs `reconcile` whenever something relevant changes (a pod of the
job, a node its pools could use) or its own timer fires. kopf stops the daemon when the job is
deleted and starts it again for every existing job when the operator restarts, so the loop
itself holds no state that matters: everything is read back from the cluster (the node view
is a cache of the node watch, see cephalo.operator.nodes).

Node events are many (1000 nodes) and bursty (a drain, a GFD relabel): each one updates the
shared node view, and wake-ups are coalesced over `node_debounce_seconds` and sent only to
jobs whose pools the changed nodes belong to (plus jobs still looking for GPUs).

Jobs waiting for GPUs (condition GpusAvailable False) are also woken, coalesced the same
way, when a Cephalo job or pod lets GPUs go: a job finishes, fails, is suspended or deleted
(its reservation ends), or one of the operator's GPU pods ends or is deleted. The shared pod
LIST is refreshed first so that they see it. GPUs freed by other workloads' pods (not
watched: the operator watches only its own pods) are seen at the next periodic re-check.
Running jobs with spec.elastic are woken the same way, after the waiting ones and oldest
first, and on node changes that give one of their pools more usable GPUs than they use
(cephalo.operator.rescale decides whether they grow).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from cephalo.api import API_GROUP, API_VERSION, PLURAL
from cephalo.operator import disruptions, leader, metrics
from cephalo.operator.config import OperatorConfig
from cephalo.operator.gpu_usage import CLAIMS, PODS, TERMINAL_POD_PHASES, pod_gpu_request
from cephalo.operator.kube import AsyncKube, Kube, load_api_client
from cephalo.operator.nodes import NODES
from cephalo.operator.reconcile import reconcile
from cephalo.operator.render import LABEL_JOB
from cephalo.operator.status import GPUS_AVAILABLE, TERMINAL_PHASES, JobPhase

log = logging.getLogger("cephalo.operator")
# A job with nothing pending (finished, failed, suspended) sleeps until an event wakes it;
# this is only the safety net against a missed event.
IDLE_SECONDS = 600.0
_wakeups: dict[tuple[str, str], asyncio.Event] = {}
# GPUs each job's plan uses per pool (product label); None: no plan yet, any GPU node matters.
_job_pools: dict[tuple[str, str], dict[str, int] | None] = {}
_changed_products: set[str] = set()  # node changes not yet sent to the jobs (debounce)
_node_wake: asyncio.TimerHandle | None = None
# Jobs whose last status says they wait for GPUs, and elastic jobs that could grow (spec.
# elastic), woken when GPUs are freed (debounced), in this order: waiting jobs first, then
# by creation time and name (the first pass to claim free GPUs gets them, see rescale.py).
_waiting_for_gpus: dict[tuple[str, str], tuple[int, str, str, str]] = {}
_elastic_jobs: set[tuple[str, str]] = set()  # Running with spec.elastic.enabled
_freed_wake: asyncio.TimerHandle | None = None
_ended_pods: set[str] = set()  # uids of GPU pods already seen terminal (woken once each)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    try:
        config = OperatorConfig.from_env()
    except ValueError as err:  # a bad setting stops the operator: no retry can fix it
        raise kopf.PermanentError(f"cephalo operator settings: {err}") from None
    # Keep kopf's bookkeeping in annotations: status belongs to the job (and the CRD schema).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.watching.server_timeout = config.watch_timeout_seconds
    # Server-side filter: the API server sends only the operator's pods, not every pod in the
    # cluster (the handler's `labels=` filter alone is applied after the whole stream arrives).
    settings.watching.label_selectors["v1", "pods"] = LABEL_JOB
    NODES.resync_seconds = config.node_resync_seconds
    # -A: GPUs in use are read from every namespace's pods; -n: from the watched ones only
    # (what a namespaced Role allows; see gpu_usage).
    PODS.clusterwide = settings.peering.clusterwide
    PODS.max_age_seconds = config.recheck_seconds  # one pod LIST per period, for all jobs
    settings.posting.level = logging.WARNING  # our own Events are explicit; no log spam
    memo.config = config
    memo.kube = AsyncKube(Kube(await asyncio.to_thread(load_api_client)))
    metrics.serve(config.metrics_port)
    if config.leader_election_namespace:
        # Last: kopf starts the handlers only once every startup handler has returned, so
        # a standby waits here and reconciles nothing (cephalo.operator.leader).
        memo.elector = await leader.elect(
            config.leader_election_namespace, config.leader_election_lease,
            config.election_timing(), config.probe_port)
    log.info("cephalo operator started: %s", config)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """After kopf stopped the handlers (SIGTERM): hand the Lease over at once, then end the
    probes' heartbeat (kopf waits up to 5 s for any task left on its loop before exiting)."""
    if (elector := getattr(memo, "elector", None)) is not None:
        await asyncio.to_thread(elector.release)
        if elector.tick is not None:
            elector.tick.cancel()


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
        _job_pools.pop((namespace, name), None)
        _elastic_jobs.discard((namespace, name))
        metrics.set_phase(namespace, name, None)


async def _sleep(wakeup: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Until woken or `seconds` pass; kopf stops async daemons by cancelling this task."""
    if stopped:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wakeup.wait(), timeout=seconds)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_changed(type: str | None, meta: kopf.Meta, event: kopf.RawEvent,
                      memo: kopf.Memo, **_: Any) -> None:
    disruptions.SEEN.note(type, dict(event["object"]))  # before the wake: the look may miss it
    _wake(meta.get("namespace"), (meta.get("labels") or {}).get(LABEL_JOB))
    if pod_frees_gpus(type, dict(event["object"]), _ended_pods):
        _schedule_freed_wake(memo.config.node_debounce_seconds)


def pod_frees_gpus(event_type: str | None, pod: dict[str, Any], ended: set[str]) -> bool:
    """Did this event free the GPUs a pod held? Once per pod: when it is first seen in a
    terminal phase (the scheduler stops counting it then), or when it is deleted before
    that. `ended` remembers the uids seen terminal (forgotten on deletion)."""
    uid = (pod.get("metadata") or {}).get("uid") or ""
    if pod_gpu_request(pod) <= 0:
        return False
    if event_type == "DELETED":
        if uid in ended:
            ended.discard(uid)
            return False
        return True
    if (pod.get("status") or {}).get("phase") in TERMINAL_POD_PHASES and uid not in ended:
        ended.add(uid)
        return True
    return False


def _schedule_freed_wake(delay_seconds: float) -> None:
    """One round of waking the jobs waiting for GPUs `delay_seconds` after GPUs were freed."""
    global _freed_wake
    if _freed_wake is None:
        _freed_wake = asyncio.get_running_loop().call_later(delay_seconds, _wake_waiting)


def _wake_waiting() -> None:
    global _freed_wake
    _freed_wake = None
    if not _waiting_for_gpus:
        return
    PODS.invalidate()  # they must see the pods that let go, not a LIST from before
    metrics.GPU_WAKEUPS.inc()
    for key in sorted(_waiting_for_gpus, key=_waiting_for_gpus.__getitem__):
        _wake(*key)


def elastic_running(spec: dict[str, Any], status: dict[str, Any]) -> bool:
    """A Running job with spec.elastic.enabled: GPUs freed or added may let it grow."""
    return bool((spec.get("elastic") or {}).get("enabled")) and status.get(
        "phase") == JobPhase.RUNNING


def waiting_for_gpus(status: dict[str, Any]) -> bool:
    """The job's last pass found no GPUs it could use (condition GpusAvailable False)."""
    return status.get("phase") not in TERMINAL_PHASES and any(
        c.get("type") == GPUS_AVAILABLE and c.get("status") == "False"
        for c in status.get("conditions") or [])


@kopf.on.event("", "v1", "nodes")
async def node_changed(type: str | None, event: kopf.RawEvent, memo: kopf.Memo,
                       **_: Any) -> None:
    products = NODES.apply(type, event["object"])  # type None: kopf's (re-)listing
    if products:
        _schedule_node_wake(products, memo.config.node_debounce_seconds)


def _schedule_node_wake(products: set[str], delay_seconds: float) -> None:
    """Collect changed products; one wake-up round `delay_seconds` after the first change."""
    global _node_wake
    _changed_products.update(products)
    if _node_wake is None:
        _node_wake = asyncio.get_running_loop().call_later(delay_seconds, _wake_for_nodes)


def _wake_for_nodes() -> None:
    global _node_wake
    _node_wake = None
    products = set(_changed_products)
    _changed_products.clear()
    available = NODES.pool_gpus()  # one discovery per burst, not one per job
    for key in list(_wakeups):
        if node_change_matters(_job_pools.get(key), products, available) or (
                key in _elastic_jobs and may_grow(_job_pools.get(key), products, available)):
            _wake(*key)


def node_change_matters(job_pools: dict[str, int] | None, products: set[str],
                        available: dict[str, int] | None) -> bool:
    """Could a change to nodes of `products` change what a job does? A job still looking
    for GPUs: yes. A planned job: only when a pool it uses now has fewer usable GPUs than its
    plan takes from it (what reconcile's re-plan check, discovery.plan_fits, looks at).
    `available`: usable GPUs per pool now; None when the view is not primed (then any change
    to a pool the job uses counts)."""
    if job_pools is None:
        return True
    touched = {pool: used for pool, used in job_pools.items() if pool in products}
    if available is None:
        return bool(touched)
    return any(available.get(pool, 0) < used for pool, used in touched.items())


def may_grow(job_pools: dict[str, int] | None, products: set[str],
             available: dict[str, int] | None) -> bool:
    """Could a change to nodes of `products` offer an elastic job more GPUs? When a changed
    pool has more usable GPUs than the job's plan takes from it (or the view is not primed)."""
    if available is None:
        return bool(products)
    return any(available.get(p, 0) > (job_pools or {}).get(p, 0) for p in products)


def pools_in_use(status: dict[str, Any]) -> dict[str, int] | None:
    """GPUs per pool a job depends on, from its status (see `_job_pools`)."""
    phase = status.get("phase")
    if phase in TERMINAL_PHASES or phase == JobPhase.SUSPENDED:
        return {}  # nothing to re-check until the spec changes
    pools = (status.get("plan") or {}).get("pools")
    if pools and phase not in (JobPhase.PLANNING, JobPhase.PROFILING):
        return {str(p): int(n) for p, n in pools.items()}  # GPUs lost there: re-plan
    return None  # still looking for GPUs: any GPU node may be the one it waits for


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def job_changed(type: str | None, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status,
                      memo: kopf.Memo, **_: Any) -> None:
    key = (meta.get("namespace") or "", meta.get("name") or "")
    deleted = type == "DELETED" or bool(meta.get("deletionTimestamp"))
    if type == "DELETED":
        _job_pools.pop(key, None)  # its daemon is gone (or going): nothing left to wake
    else:
        _job_pools[key] = pools_in_use(dict(status))
    waiting = not deleted and waiting_for_gpus(dict(status))
    elastic = not deleted and elastic_running(dict(spec), dict(status))
    if waiting or elastic:
        _waiting_for_gpus[key] = (0 if waiting else 1, str(meta.get("creationTimestamp") or ""),
                                  *key)
    else:
        _waiting_for_gpus.pop(key, None)
    if elastic:
        _elastic_jobs.add(key)
    else:
        _elastic_jobs.discard(key)
    # GPUs the job holds for the others' planning (also after an operator restart); a
    # reservation that ends frees GPUs for the jobs waiting.
    if CLAIMS.observe(key, meta.get("uid"), dict(status), deleted=deleted):
        _schedule_freed_wake(memo.config.node_debounce_seconds)
    # Our own status writes leave generation == observedGeneration: no need to wake for them.
    if meta.get("generation") != status.get("observedGeneration") or meta.get(
            "deletionTimestamp"):
        _wake(meta.get("namespace"), meta.get("name"))
