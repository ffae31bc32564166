"""`CephaloClient`: submit, read, watch, wait for, suspend, resume and delete CephaloJobs.

Usable from a notebook: a client holds its own connection (no module state), returns the
API's own types (`Job` carries a `CephaloJobSpec` and a `CephaloJobStatus`), and raises
`cephalo.client.errors.ClientError`s with one-line messages.

    from cephalo.client import CephaloClient
    client = CephaloClient(context="prod", namespace="team-a")
    job = client.submit("examples/custom-tiny-gpt.yaml")
    for update in client.watch(job.name):
        print(update.phase, update.status.progress)
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from cephalo.api import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    CephaloJob,
    JobFileError,
    Plan,
    load_job,
    parse_job,
)
from cephalo.api.plan import PlanError, parse_plan
from cephalo.api.safeyaml import load_yaml_file
from cephalo.client.cluster_plan import ClusterPlan, plan_on_cluster
from cephalo.client.connection import RESOURCE, Session, Target, connect
from cephalo.client.errors import (
    ApiRefused,
    Forbidden,
    JobFailed,
    JobNotFound,
    Unreachable,
    WaitTimeout,
)
from cephalo.client.jobs import Job, job_from
from cephalo.client.logs import JobLogs, LogLine
from cephalo.operator.kube import core_path, job_path
from cephalo.operator.render import check_job_name

# A watch asks the server to end the stream after this long (then resumes from where it
# was): a proxy that silently drops idle connections cannot hang a watch for longer.
WATCH_SERVER_TIMEOUT_SECONDS = 60
RECONNECT_ATTEMPTS = 5  # a watch whose server stays unreachable this many times in a row fails
JOBS_PATH = f"/apis/{API_GROUP}/{API_VERSION}"


class CephaloClient:
    """CephaloJobs on one cluster: the kubeconfig's context (default: its current one) and
    namespace (default: the context's, else "default")."""

    def __init__(self, *, context: str | None = None, namespace: str | None = None,
                 kubeconfig: str | None = None) -> None:
        api, target = connect(kubeconfig, context, namespace)
        self.session = Session(api, target)

    @property
    def target(self) -> Target:
        return self.session.target

    @property
    def namespace(self) -> str:
        return self.target.namespace

    def _ns(self, namespace: str | None) -> str:
        return namespace or self.namespace

    # ---- submit -------------------------------------------------------------------------
    def submit(self, job: str | dict[str, Any] | CephaloJob, *,
               namespace: str | None = None) -> Job:
        """Validate `job` (a YAML path, a dict or a CephaloJob) with the admission types,
        then create it. Nothing is sent when it does not validate (a JobFileError)."""
        parsed = validate_job(job)
        ns = self._ns(namespace or parsed.metadata.namespace)
        if parsed.metadata.namespace and namespace and parsed.metadata.namespace != namespace:
            raise ApiRefused(f"the job file says namespace {parsed.metadata.namespace!r} but "
                             f"--namespace {namespace!r} was given: drop one of them")
        body = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                "metadata": {**_user_metadata(parsed), "namespace": ns},
                "spec": _spec_as_written(job, parsed)}
        self.session.check_crd()
        try:
            created = self.session.call("create", RESOURCE, ns, self.session.kube.request,
                                        "POST", job_path(ns), body)
        except ApiRefused as err:
            if err.status == 409:
                raise ApiRefused(f"a CephaloJob {parsed.metadata.name!r} already exists in "
                                 f"namespace {ns}: delete it first (cephalo delete "
                                 f"{parsed.metadata.name} -n {ns}) or rename yours",
                                 409) from None
            raise
        return job_from(created)

    # ---- read ---------------------------------------------------------------------------
    def get(self, name: str, *, namespace: str | None = None) -> Job:
        ns = self._ns(namespace)
        self.session.check_crd()
        obj = self.session.call("get", RESOURCE, ns, self.session.kube.get, job_path(ns, name))
        if obj is None:
            raise self._not_found(name, ns)
        return job_from(obj)

    def list(self, *, namespace: str | None = None, all_namespaces: bool = False) -> list[Job]:
        ns = None if all_namespaces else self._ns(namespace)
        self.session.check_crd()
        path = f"{JOBS_PATH}/{PLURAL}" if ns is None else job_path(ns)
        items = self.session.call("list", RESOURCE, ns, self.session.kube.list, path)
        return sorted((job_from(o) for o in items), key=lambda j: (j.namespace, j.name))

    def plan(self, job: Job) -> Plan | None:
        """The job's full plan (its `<job>-plan` ConfigMap), None before it is planned (or
        when RBAC hides ConfigMaps)."""
        name = (job.status.plan.config_map if job.status.plan else None) or f"{job.name}-plan"
        try:
            cm = self.session.call("get", "configmaps", job.namespace, self.session.kube.get,
                                   core_path(job.namespace, "configmaps", name))
        except Forbidden:  # RBAC shows the job but not its ConfigMaps: status without a plan
            return None
        try:
            return parse_plan(json.loads(((cm or {}).get("data") or {}).get("plan.json", "")))
        except (PlanError, ValueError):
            return None

    def events(self, job: Job, limit: int = 10) -> builtins.list[dict[str, Any]]:
        """The job's most recent Events, oldest first (empty when RBAC hides them)."""
        selector = quote(f"involvedObject.name={job.name},involvedObject.kind={KIND}", safe="")
        try:
            events = self.session.call(
                "list", "events", job.namespace, self.session.kube.list,
                f"{core_path(job.namespace, 'events')}?fieldSelector={selector}")
        except Forbidden:
            return []
        events = [e for e in events if (e.get("involvedObject") or {}).get("uid") in (
            None, job.uid)]
        events.sort(key=lambda e: (e.get("lastTimestamp") or e.get("eventTime")
                                   or (e.get("metadata") or {}).get("creationTimestamp") or ""))
        return events[-limit:]

    def _not_found(self, name: str, namespace: str) -> JobNotFound:
        """No such job here; the message names the namespaces that have one, if any."""
        elsewhere: list[str] = []
        try:
            query = quote(f"metadata.name={name}", safe="")
            elsewhere = sorted(str(o["metadata"]["namespace"]) for o in self.session.call(
                "list", RESOURCE, None, self.session.kube.list,
                f"{JOBS_PATH}/{PLURAL}?fieldSelector={query}")
                if o["metadata"].get("name") == name)
        except (Forbidden, ApiRefused):
            pass  # cannot look cluster-wide: say only what we know
        if elsewhere:
            return JobNotFound(f"no CephaloJob {name!r} in namespace {namespace}; there is one "
                               f"in namespace {', '.join(elsewhere)}: add --namespace "
                               f"{elsewhere[0]}")
        return JobNotFound(f"no CephaloJob {name!r} in namespace {namespace} "
                           f"({self.target.where()}); `cephalo status` lists the jobs there")

    # ---- watch and wait -----------------------------------------------------------------
    def watch(self, name: str, *, namespace: str | None = None,
              timeout_seconds: float | None = None) -> Iterator[Job]:
        """The job now, then every change to it, until it Succeeded or Failed (or
        `timeout_seconds` passed). Survives dropped streams (resumes from the last
        resourceVersion) and 410 Gone (reads the job again)."""
        ns = self._ns(namespace)
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        failures = 0
        job = self.get(name, namespace=ns)
        yield job
        query = {"watch": "true", "fieldSelector": f"metadata.name={name}",
                 "allowWatchBookmarks": "true"}
        while not job.finished:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            server_timeout = int(min(WATCH_SERVER_TIMEOUT_SECONDS, max(1.0, left or 1e9)))
            gone = False
            try:
                lines = self.session.stream(
                    job_path(ns), {**query, "resourceVersion": job.resource_version,
                                   "timeoutSeconds": str(server_timeout)},
                    "watch", RESOURCE, ns, read_timeout_seconds=server_timeout + 30)
                first = next(lines, None)
            except ApiRefused as err:
                if err.status != 410:
                    raise
                first, gone = None, True  # answered 410 Gone outright: list again
            except Unreachable:
                # An API server restarting, a proxy hiccup: retry a few times, then say so.
                failures += 1
                if failures > RECONNECT_ATTEMPTS:
                    raise
                time.sleep(min(2.0**failures, 10.0))
                continue
            failures = 0
            for line in ([] if first is None else itertools.chain([first], lines)):
                event = _event(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    gone = obj.get("code") == 410
                    break
                if kind == "BOOKMARK":
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                    job = job if not rv else _with_version(job, str(rv))
                    continue
                if kind == "DELETED":
                    raise JobNotFound(f"CephaloJob {name!r} in namespace {ns} was deleted "
                                      "while being watched")
                if kind in ("ADDED", "MODIFIED") and obj.get("metadata", {}).get("name") == name:
                    job = job_from(obj)
                    yield job
                    if job.finished:
                        return
            if gone or not job.resource_version:
                # Too old to resume from (410 Gone): start again from the job as it is now.
                fresh = self.get(name, namespace=ns)
                if fresh.resource_version != job.resource_version:
                    job = fresh
                    yield job

    def wait(self, name: str, *, namespace: str | None = None,
             timeout_seconds: float | None = None, raise_on_failure: bool = False) -> Job:
        """Block until the job Succeeded or Failed; WaitTimeout after `timeout_seconds`.
        With `raise_on_failure`, a Failed job raises JobFailed with its reason."""
        last = collections.deque(self.watch(name, namespace=namespace,
                                            timeout_seconds=timeout_seconds), maxlen=1)[0]
        if not last.finished:
            raise WaitTimeout(f"CephaloJob {name!r} is still {last.phase} after "
                              f"{timeout_seconds:g} s")
        if raise_on_failure and last.phase == "Failed":
            raise JobFailed(f"CephaloJob {name!r} failed: {last.failure_reason}")
        return last

    # ---- logs and plans -----------------------------------------------------------------
    def logs(self, name: str, *, namespace: str | None = None, rank: int | None = None,
             follow: bool = False, profilers: bool = True,
             poll_seconds: float = 1.0) -> Iterator[LogLine]:
        """The job's pod logs, each line prefixed by its rank (or profiler); with `follow`,
        as they are written, into the next attempt's pods after a gang restart, until the
        job finished or was deleted (then the last pods' streams are read to their end, as
        `kubectl logs -f` ends with its pod). `rank`: only the pod that runs that rank (no
        profilers)."""
        ns = self._ns(namespace)
        self.get(name, namespace=ns)  # a missing job is an error, not an empty log
        reader = JobLogs(self.session, ns, name, rank=rank, profilers=profilers,
                         poll_seconds=poll_seconds)
        if not follow:
            yield from reader.read()
            return
        def ended() -> bool:
            try:
                return self.get(name, namespace=ns).finished
            except JobNotFound:  # deleted while followed: its pods' streams end with them
                return True
        yield from reader.follow(ended)

    def plan_on_cluster(self, job: str | dict[str, Any] | CephaloJob, *,
                        namespace: str | None = None,
                        trainer_image: str | None = None) -> ClusterPlan:
        """The plan the operator would choose for `job` now, on the GPUs free for it, with
        the profiles it has cached; says which GPUs are taken and by whom. `trainer_image`:
        the operator's configured image, for a job without spec.image (the profile cache
        key includes it; default: the chart's)."""
        parsed = validate_job(job)
        ns = self._ns(namespace or parsed.metadata.namespace)
        self.session.check_crd()
        return plan_on_cluster(self.session, parsed, ns, trainer_image)

    # ---- change -------------------------------------------------------------------------
    def suspend(self, name: str, *, namespace: str | None = None) -> Job:
        """spec.suspend: true (every pod goes; the last checkpoint is kept)."""
        return self._patch_spec(name, namespace, {"suspend": True})

    def resume(self, name: str, *, namespace: str | None = None) -> Job:
        """spec.suspend: false (the gang starts again from the last checkpoint)."""
        return self._patch_spec(name, namespace, {"suspend": False})

    def _patch_spec(self, name: str, namespace: str | None, spec: dict[str, Any]) -> Job:
        ns = self._ns(namespace)
        self.session.check_crd()
        obj = self.session.call("patch", RESOURCE, ns, self.session.kube.patch,
                                job_path(ns, name), {"spec": spec})
        if obj is None:
            raise self._not_found(name, ns)
        return job_from(obj)

    def delete(self, name: str, *, namespace: str | None = None) -> None:
        """Delete the job; its pods, Service and plan go with it (garbage collection)."""
        ns = self._ns(namespace)
        self.session.check_crd()
        if not self.session.call("delete", RESOURCE, ns, self.session.kube.delete,
                                 job_path(ns, name)):
            raise self._not_found(name, ns)



def validate_job(job: str | dict[str, Any] | CephaloJob) -> CephaloJob:
    """The job as admission sees it (the CRD's pydantic types) plus the operator's name rule;
    a JobFileError (one line) when it would be refused. Needs metadata.name."""
    if isinstance(job, CephaloJob):
        parsed = job
    elif isinstance(job, dict):
        parsed = parse_job(job, source="job")
    else:
        parsed = load_job(str(job))
    source = job if isinstance(job, str) else "job"
    if not parsed.metadata.name:
        raise JobFileError(f"{source}: metadata.name is required to submit a job")
    try:
        check_job_name(parsed.metadata.name)
    except ValueError as err:
        raise JobFileError(f"{source}: {err}") from None
    return parsed


def _user_metadata(parsed: CephaloJob) -> dict[str, Any]:
    """name, labels and annotations as written (the Kueue queue label is a label)."""
    meta = parsed.metadata.model_dump(exclude_none=True)
    return {k: v for k, v in meta.items() if k in ("name", "labels", "annotations")}


def _spec_as_written(job: str | dict[str, Any] | CephaloJob, parsed: CephaloJob) -> Any:
    """The spec as the user wrote it (as `kubectl apply` sends it: the CRD's defaults apply
    on the server), once it validated; a CephaloJob object is sent in full."""
    if isinstance(job, CephaloJob):
        return parsed.spec.to_wire()
    raw = job if isinstance(job, dict) else load_yaml_file(str(job), what="CephaloJob YAML file")
    return raw["spec"]


def _event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def _with_version(job: Job, resource_version: str) -> Job:
    return dataclasses.replace(job, resource_version=resource_version)
