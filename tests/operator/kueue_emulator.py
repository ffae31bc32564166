"""Kueue's plain-pod integration, emulated inside the API emulator (the test's event loop).

What Kueue documents for plain pods (https://kueue.sigs.k8s.io/docs/tasks/run/plain_pods/)
and what its pod webhook and controller do, reduced to what an operator can observe:

* webhook: a pod created with `kueue.x-k8s.io/queue-name` gets the scheduling gate
  `kueue.x-k8s.io/admission`, the label `kueue.x-k8s.io/managed: "true"` and the finalizer
  `kueue.x-k8s.io/managed` (Kueue versions before the finalizer's removal, kueue#8530);
* a pod group (`kueue.x-k8s.io/pod-group-name` label, `…/pod-group-total-count` annotation,
  consistent on every member) is one Workload, admitted only when all total-count pods exist
  and the ClusterQueue's quota per ResourceFlavor allows the whole group; a pod without the
  group label is its own Workload;
* flavors are keyed on `nvidia.com/gpu.product`, as a ResourceFlavor with that node label:
  a pod's flavor is the product its nodeSelector asks for (quota in `nvidia.com/gpu`);
* admission removes the gate from every pod of the Workload, at once;
* quota is released when the Workload finishes: every pod succeeded; or a pod carries
  `kueue.x-k8s.io/retriable-in-group: "false"` and every pod is terminated; a single pod
  when it terminates; or every pod is gone (a Workload is owned by its pods, so the garbage
  collector removes it with them). A group that lost pods otherwise keeps its quota,
  waiting for replacement pods (Kueue does not re-create pods);
* the finalizer comes off a terminated or deleted pod only once its Workload is finished
  (or was never admitted): a deleted pod of an unfinished group stays Terminating until a
  replacement comes, as reported in kueue#1339 and skypilot#9918.

Not emulated: preemption, cohorts, the Workload objects themselves (`admitted` below is
their admitted state).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

from kube_emulator import ApiEmulator
from kube_selectors import ObjKey

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
GATE = "kueue.x-k8s.io/admission"
MANAGED = "kueue.x-k8s.io/managed"
FLAVOR_LABEL = "nvidia.com/gpu.product"
GPU = "nvidia.com/gpu"


@dataclass
class Workload:
    name: str  # the group name, or the pod's own name for a single pod
    namespace: str
    usage: dict[str, int]  # GPUs per flavor
    pods: set[str] = field(default_factory=set)


@dataclass
class KueueEmulation:
    """One ClusterQueue with `quota` GPUs per flavor, fed by the LocalQueues `queues`."""

    api: ApiEmulator
    quota: dict[str, int]
    queues: frozenset[str] = frozenset({"team-a"})
    admitted: dict[tuple[str, str], Workload] = field(default_factory=dict)
    finished: list[tuple[str, str]] = field(default_factory=list)  # in order
    admissions: list[tuple[str, str]] = field(default_factory=list)  # in order
    _order: dict[tuple[str, str], int] = field(default_factory=dict)  # first seen: FIFO
    # Finished Workloads whose pods are still there (kept for logs): never admitted again;
    # the Workload goes with its last pod, and a later group of that name is a new one.
    _done: set[tuple[str, str]] = field(default_factory=set)
    _scheduled: bool = False

    def install(self) -> KueueEmulation:
        self.api.pod_webhooks.append(self._webhook)
        self.api.on_change.append(self._changed)
        return self

    hold: bool = False  # ClusterQueue spec.stopPolicy: Hold (no new admissions)

    def set_quota(self, flavor: str, gpus: int) -> None:
        """An administrator edits the ClusterQueue's nominal quota of one flavor."""
        self.quota[flavor] = gpus
        self._reconcile()

    def set_hold(self, hold: bool) -> None:
        """ClusterQueue `spec.stopPolicy: Hold` (True) or `None` (False): admitted workloads
        keep running; pending ones wait."""
        self.hold = hold
        self._reconcile()

    # ---- webhook -------------------------------------------------------------------------
    def _webhook(self, pod: dict[str, Any]) -> None:
        labels = pod.setdefault("metadata", {}).setdefault("labels", {})
        if not labels.get(QUEUE_LABEL):
            return
        labels[MANAGED] = "true"
        finalizers = pod["metadata"].setdefault("finalizers", [])
        if MANAGED not in finalizers:
            finalizers.append(MANAGED)
        gates = pod.setdefault("spec", {}).setdefault("schedulingGates", [])
        if {"name": GATE} not in gates:
            gates.append({"name": GATE})

    # ---- controller ----------------------------------------------------------------------
    def _changed(self, key: ObjKey, kind: str, obj: dict[str, Any]) -> None:
        if key[:2] != ("", "pods") or self._scheduled:
            return
        self._scheduled = True  # one pass per burst, after the write that woke it
        asyncio.get_running_loop().call_soon(self._reconcile)

    def usage(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for workload in self.admitted.values():
            for flavor, gpus in workload.usage.items():
                used[flavor] = used.get(flavor, 0) + gpus
        return used

    def _reconcile(self) -> None:
        self._scheduled = False
        groups: dict[tuple[str, str], list[tuple[ObjKey, dict[str, Any]]]] = {}
        for key, pod in list(self.api._store.items()):
            if key[:2] != ("", "pods"):
                continue
            labels = pod["metadata"].get("labels") or {}
            if labels.get(QUEUE_LABEL) not in self.queues:
                continue
            name = labels.get(GROUP_LABEL) or pod["metadata"]["name"]
            groups.setdefault((key[2] or "", name), []).append((key, pod))
        for wkey in list(self.admitted):
            if self._finished(groups.get(wkey, [])):
                del self.admitted[wkey]
                self.finished.append(wkey)
                self._done.add(wkey)
        self._done &= set(groups)
        for wkey, members in groups.items():
            if wkey not in self.admitted:  # finished, or never admitted: let stopped pods go
                for key, pod in members:
                    self._release_finalizer(key, pod)
        # Pending workloads in creation order (Kueue's StrictFIFO by creation timestamp).
        for wkey in groups:
            self._order.setdefault(wkey, len(self._order))
        for wkey in [k for k in self._order if k not in groups and k not in self.admitted]:
            del self._order[wkey]  # gone before admission: a later namesake queues anew
        pending = sorted((k for k in groups if k not in self.admitted and k not in self._done),
                         key=self._order.get)
        for wkey in pending:
            if not self.hold:
                self._try_admit(wkey, groups[wkey])

    def _release_finalizer(self, key: ObjKey, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        stopped = meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in (
            "Succeeded", "Failed")
        if not stopped or MANAGED not in (meta.get("finalizers") or []):
            return
        freed = copy.deepcopy(pod)
        freed["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != MANAGED]
        if not freed["metadata"]["finalizers"]:
            del freed["metadata"]["finalizers"]
        self.api.replace_object(key, freed)
        if meta.get("deletionTimestamp") and not freed["metadata"].get("finalizers"):
            # The last finalizer went: the API server lets it go; a pod still running on a
            # node goes when its kubelet has stopped it and reported so.
            if self.api._runs_on_a_node(freed):
                asyncio.get_running_loop().call_later(
                    self.api.kubelet_stop_seconds, self.api._kubelet_stopped, key,
                    freed["metadata"]["uid"])
            else:
                self.api._remove(key)

    def _finished(self, members: list[tuple[ObjKey, dict[str, Any]]]) -> bool:
        if not members:
            return True  # every pod gone: the Workload goes with its owners
        phases = [(p.get("status") or {}).get("phase") for _, p in members]
        if all(ph == "Succeeded" for ph in phases):
            return True
        if GROUP_LABEL not in (members[0][1]["metadata"].get("labels") or {}):
            return phases[0] == "Failed"  # a single pod: finished when it terminates
        stopped = all(ph in ("Succeeded", "Failed") or p["metadata"].get("deletionTimestamp")
                      for ph, (_, p) in zip(phases, members, strict=True))
        return stopped and any((p["metadata"].get("annotations") or {}).get(RETRIABLE) == "false"
                               for _, p in members)

    def _try_admit(self, wkey: tuple[str, str],
                   members: list[tuple[ObjKey, dict[str, Any]]]) -> None:
        live = [(k, p) for k, p in members if not p["metadata"].get("deletionTimestamp")]
        if not live:
            return
        annotations = live[0][1]["metadata"].get("annotations") or {}
        total = int(annotations.get(TOTAL_COUNT, "1")) if GROUP_LABEL in (
            live[0][1]["metadata"].get("labels") or {}) else 1
        if len(live) < total:
            return  # Kueue waits for the whole group before it even considers admission
        usage: dict[str, int] = {}
        for _, pod in live:
            flavor = ((pod.get("spec") or {}).get("nodeSelector") or {}).get(FLAVOR_LABEL, "")
            for container in pod["spec"].get("containers") or []:
                gpus = int(((container.get("resources") or {}).get("requests") or {}).get(GPU, 0))
                if gpus:
                    usage[flavor] = usage.get(flavor, 0) + gpus
        used = self.usage()
        if any(flavor not in self.quota or used.get(flavor, 0) + gpus > self.quota[flavor]
               for flavor, gpus in usage.items()):
            return  # does not fit: stays queued, gated
        self.admitted[wkey] = Workload(wkey[1], wkey[0], usage, {k[3] for k, _ in live})
        self.admissions.append(wkey)
        for key, pod in live:
            if not gated(pod):
                continue
            ungated = copy.deepcopy(pod)
            ungated["spec"]["schedulingGates"] = [
                g for g in ungated["spec"].get("schedulingGates") or [] if g.get("name") != GATE]
            if not ungated["spec"]["schedulingGates"]:
                del ungated["spec"]["schedulingGates"]
                status = ungated.setdefault("status", {})
                status["conditions"] = [c for c in status.get("conditions") or []
                                        if c.get("reason") != "SchedulingGated"]
            self.api.replace_object(key, ungated)


def gated(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])
