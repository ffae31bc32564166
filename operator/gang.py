"""Gang admission (pure): which gang scheduler a job uses, and what it needs on the pods.

Three ways a cluster admits the rank pods of a job as one unit, each followed as documented:

* **Kueue** (plain pods, "Running a group of Pods to be admitted together",
  https://kueue.sigs.k8s.io/docs/tasks/run/plain_pods/): every rank pod carries the label
  `kueue.x-k8s.io/queue-name` (copied from the CephaloJob), the label
  `kueue.x-k8s.io/pod-group-name` and the annotation `kueue.x-k8s.io/pod-group-total-count`
  (= world size), consistently. Kueue's webhook gates each pod (`kueue.x-k8s.io/admission`)
  and removes the gate from all of them once the group's Workload is admitted. The group
  name includes the attempt and the plan's hash: a restarted or re-planned gang is a new
  group (Kueue does not re-create pods, and a group's size may change with a new plan). So
  no group is ever retried in place, and every rank pod says so from its creation with
  `kueue.x-k8s.io/retriable-in-group: "false"`, the documented way ("Termination") to have
  Kueue finish the Workload, and free its quota, once all its pods are terminated. Without
  it, a failed gang's kept pods would hold the quota for replacements that never come, and
  Kueue versions that put their `kueue.x-k8s.io/managed` finalizer on pods keep a deleted
  pod of an unfinished group Terminating until a replacement appears: a replacement named
  `<job>-rank-<i>` cannot be created while its predecessor exists (a deadlock on every gang
  restart).
  Profiler pods carry only the queue label: each is a single plain pod Kueue admits alone.
* **Volcano** (https://volcano.sh/en/docs/podgroup/): a `scheduling.volcano.sh/v1beta1`
  PodGroup with minMember = world size, minTaskMember per GPU pool (each rank pod names its
  pool in `volcano.sh/task-spec`, the annotation Volcano's scheduler reads as the task),
  queue, priorityClassName and minResources (the sum of the rank pods' requests); pods set
  `schedulerName: volcano` and the annotation `scheduling.k8s.io/group-name`.
* **scheduler-plugins coscheduling** (kubernetes-sigs/scheduler-plugins doc/install.md,
  "Test Coscheduling"): a `scheduling.x-k8s.io/v1alpha1` PodGroup with minMember = world
  size and scheduleTimeoutSeconds; pods carry the label `scheduling.x-k8s.io/pod-group` and
  the scheduler's name (the second scheduler is `scheduler-plugins-scheduler` by default).

With none of them, `spec.schedulingPolicy.scheduleTimeoutSeconds` is the operator's own
pending timeout (it releases the gang itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from cephalo.api import API_GROUP, CephaloJob

GangScheduler = Literal["kueue", "volcano", "scheduler-plugins", "none"]

# Kueue (pkg/controller/jobs/pod/constants)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
KUEUE_GATE = "kueue.x-k8s.io/admission"
KUEUE_MANAGED = "kueue.x-k8s.io/managed"  # label and finalizer Kueue puts on managed pods
# Volcano (apis/pkg/apis/scheduling/v1beta1/labels.go, batch TaskSpecKey)
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_TASK_ANNOTATION = "volcano.sh/task-spec"
VOLCANO_SCHEDULER = "volcano"
# scheduler-plugins coscheduling
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"
LABEL_GANG = f"{API_GROUP}/gang"  # on PodGroups: the group name, to find stale ones


@dataclass(frozen=True)
class PodGroupApi:
    group: str
    version: str
    kind: str = "PodGroup"
    plural: str = "podgroups"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


POD_GROUP_APIS: dict[str, PodGroupApi] = {
    "volcano": PodGroupApi("scheduling.volcano.sh", "v1beta1"),
    "scheduler-plugins": PodGroupApi("scheduling.x-k8s.io", "v1alpha1"),
}


def kueue_queue(job: CephaloJob) -> str | None:
    """The LocalQueue the job's pods go to: the CephaloJob's own Kueue label."""
    labels = (job.metadata.model_extra or {}).get("labels") or {}
    return labels.get(KUEUE_QUEUE_LABEL) or None


def gang_scheduler(job: CephaloJob) -> GangScheduler:
    """Who admits the gang as one unit. The Kueue label wins (Kueue admits, the scheduler
    named in schedulingPolicy still places); then `gangScheduler`, then the scheduler name.
    "none": the operator's own pending timeout is the only guard against a half-placed gang."""
    if kueue_queue(job):
        return "kueue"
    policy = job.spec.scheduling_policy
    if policy is None:
        return "none"
    if policy.gang_scheduler:
        return policy.gang_scheduler
    if policy.scheduler_name == VOLCANO_SCHEDULER:
        return "volcano"
    if policy.scheduler_name == COSCHEDULING_SCHEDULER:
        return "scheduler-plugins"
    return "none"


def pod_group_api(job: CephaloJob) -> PodGroupApi | None:
    """The PodGroup API the job's gang needs an object of (None: Kueue or no gang scheduler)."""
    return POD_GROUP_APIS.get(_pod_group_scheduler(job))


def _pod_group_scheduler(job: CephaloJob) -> str:
    """Volcano or coscheduling as chosen by schedulingPolicy alone (Kueue aside): a job
    queued in Kueue *and* scheduled by Volcano still needs Volcano's PodGroup."""
    policy = job.spec.scheduling_policy
    if policy is None:
        return "none"
    if policy.gang_scheduler:
        return policy.gang_scheduler
    return {VOLCANO_SCHEDULER: "volcano", COSCHEDULING_SCHEDULER: "scheduler-plugins"}.get(
        policy.scheduler_name or "", "none")


def pod_groups_path(api: PodGroupApi, namespace: str, name: str | None = None) -> str:
    path = f"/apis/{api.group}/{api.version}/namespaces/{quote(namespace)}/{api.plural}"
    return path + (f"/{quote(name)}" if name else "")


def group_name(job_name: str, attempt: int, digest: str) -> str:
    """One group per attempt and plan: `<job>-g<attempt>-<hash8>` (at most 47 + 2 + 4 + 9 =
    62 characters: a label value and a DNS subdomain)."""
    return f"{job_name}-g{attempt}-{digest[:8]}"


def _scheduler_name(job: CephaloJob) -> str | None:
    policy = job.spec.scheduling_policy
    if policy is None:
        return None
    if policy.scheduler_name:
        return policy.scheduler_name
    return {"volcano": VOLCANO_SCHEDULER, "scheduler-plugins": COSCHEDULING_SCHEDULER}.get(
        _pod_group_scheduler(job))


def _priority_class(job: CephaloJob) -> str | None:
    policy = job.spec.scheduling_policy
    return policy.priority_class_name if policy else None


def apply_scheduling(pod: dict[str, Any], job: CephaloJob) -> dict[str, Any]:
    """Fields every pod of the job gets (profilers too): scheduler, priority, Kueue queue.
    A profiler is one plain pod for Kueue (admitted alone) and a pod without a group for
    Volcano (its controller makes a one-pod PodGroup) and coscheduling (scheduled alone)."""
    spec, meta = pod["spec"], pod["metadata"]
    if scheduler := _scheduler_name(job):
        spec["schedulerName"] = scheduler
    if priority := _priority_class(job):
        spec["priorityClassName"] = priority  # schedulingPolicy wins over podTemplate
    if queue := kueue_queue(job):
        meta["labels"][KUEUE_QUEUE_LABEL] = queue
    return pod


def apply_gang(pod: dict[str, Any], job: CephaloJob, *, group: str, group_size: int,
               task: str) -> dict[str, Any]:
    """A rank pod's membership of its gang, for each admission mechanism the job uses.
    `group_size`: the pods of the gang (Kueue counts pods, not ranks: the world size with
    one rank per pod, fewer when pods run several ranks, spec.ranksPerPod)."""
    apply_scheduling(pod, job)
    meta = pod["metadata"]
    annotations = meta.setdefault("annotations", {})
    if kueue_queue(job):
        meta["labels"][KUEUE_GROUP_LABEL] = group
        annotations[KUEUE_TOTAL_COUNT] = str(group_size)
        annotations[KUEUE_RETRIABLE] = "false"  # a new attempt is a new group (see above)
    scheduler = _pod_group_scheduler(job)
    if scheduler == "volcano":
        annotations[VOLCANO_GROUP_ANNOTATION] = group
        annotations[VOLCANO_TASK_ANNOTATION] = task
    elif scheduler == "scheduler-plugins":
        meta["labels"][COSCHEDULING_GROUP_LABEL] = group
    return pod


def _add_quantities(total: dict[str, float], requests: dict[str, Any]) -> None:
    for resource, value in requests.items():
        total[resource] = total.get(resource, 0.0) + _quantity(value)


_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _quantity(value: Any) -> float:
    """A Kubernetes quantity as a number (the subset pods use: plain, milli, SI, binary)."""
    text = str(value)
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return float(text)


def _format_quantity(resource: str, amount: float) -> str:
    if resource == "cpu" and amount != int(amount):
        return f"{round(amount * 1000)}m"
    return str(round(amount))


def render_pod_group(job: CephaloJob, rank_pods: list[dict[str, Any]], *, group: str,
                     owner: dict[str, Any]) -> dict[str, Any] | None:
    """The PodGroup the job's gang scheduler expects before the rank pods (None: none)."""
    api = pod_group_api(job)
    if api is None:
        return None
    world_size = len(rank_pods)  # pods, not ranks (a pod may run several)
    meta = {"name": group, "namespace": job.metadata.namespace,
            "labels": {f"{API_GROUP}/job": job.metadata.name or "", LABEL_GANG: group},
            "ownerReferences": [owner]}
    policy = job.spec.scheduling_policy
    assert policy is not None, "a PodGroup API is only chosen through schedulingPolicy"
    spec: dict[str, Any] = {"minMember": world_size}
    if api is POD_GROUP_APIS["volcano"]:
        tasks: dict[str, int] = {}
        requests: dict[str, float] = {}
        for pod in rank_pods:
            task = pod["metadata"]["annotations"][VOLCANO_TASK_ANNOTATION]
            tasks[task] = tasks.get(task, 0) + 1
            for container in pod["spec"]["containers"]:
                _add_quantities(requests, (container.get("resources") or {}).get(
                    "requests") or {})
        # Every rank pod is needed (minMember = pods: the world size, fewer with several
        # ranks a pod), so each pool's task needs all its pods; Volcano then checks each GPU
        # type's pool on its own (minResources counts every pod's GPUs).
        spec["minTaskMember"] = dict(sorted(tasks.items()))
        spec["minResources"] = {r: _format_quantity(r, v) for r, v in sorted(requests.items())}
        if policy.queue:
            spec["queue"] = policy.queue
        if policy.priority_class_name:
            spec["priorityClassName"] = policy.priority_class_name
    elif policy.schedule_timeout_seconds is not None:
        spec["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds
    return {"apiVersion": api.api_version, "kind": api.kind, "metadata": meta, "spec": spec}


__all__ = ["GangScheduler", "apply_gang", "apply_scheduling", "gang_scheduler", "group_name",
           "kueue_queue", "pod_group_api", "render_pod_group"]
