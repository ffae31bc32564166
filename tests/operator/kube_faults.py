"""What a real API server and kubelet do to an operator that a happy-path emulator does not.

A mixin of `kube_emulator.ApiEmulator` (split out to keep modules small):

* **write faults** (`Faults.write_error_fraction`, seeded): a POST/PATCH/PUT/DELETE from the
  operator's own client is answered 500 or 409 *before* it takes effect, or 500 *after* it
  took effect (the reply was lost: a timeout, an apiserver restart) — the case that makes a
  naive "create, then record" controller create twice or mourn a pod it never made;
* **expired resourceVersions** (`Faults.expire_watches`): a resumed watch gets 410 Gone;
* **watch drops** (`Faults.watch_drop_seconds`): every watch stream ends after that long, as
  apiservers and load balancers do; clients must resume from their last resourceVersion;
* **lagging watches** (`Faults.watch_delay_seconds`, per resource): events reach watchers
  that long after the write, while lists and gets already show it (the watch follows the
  store: a busy apiserver's watch cache, a slow client's queue);
* **delayed garbage collection** (`Faults.gc_delay_seconds`): dependents of a deleted owner go
  a while after it (the real GC is a separate controller working from its own informers),
  and one created after all its owners went is collected too (the GC finds dangling owners);
  `propagationPolicy: Orphan` strips the owner's references from its dependents instead;
* **graceful pod deletion**: a pod running on a node is not removed by DELETE; it gets
  `deletionTimestamp`, its containers get SIGTERM (the emulated kubelet ends them with exit
  code 143 after `kubelet_stop_seconds`, the trainer's checkpoint-and-exit), then it goes.
  Pods not running (never scheduled, or already terminated) go at once, as on a real server;
* **eviction** (`POST pods/<name>/eviction`, what `kubectl drain` does): the pod gets a
  `DisruptionTarget` condition (`EvictionByEvictionAPI`), then graceful deletion.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import random
from dataclasses import dataclass, field
from typing import Any

from kmock._internal import rendering
from kube_selectors import ObjKey
from kube_selectors import api_error as _error

WRITE_METHODS = ("POST", "PATCH", "PUT", "DELETE")
# The operator's own requests come from the `kubernetes` client; kopf's and the tests' own
# requests (kopf's bookkeeping, the test playing kubectl and the kubelet) are never faulted.
OPERATOR_USER_AGENT = "OpenAPI-Generator/"
TERMINATED_BY_SIGTERM = 143


def server_time(skew_seconds: float = 0.0) -> str:
    """The API server's clock, which need not agree with the operator's (`skew_seconds`)."""
    now = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=skew_seconds)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Faults:
    """Fault injection settings; the default injects nothing."""

    seed: int = 0
    write_error_fraction: float = 0.0
    watch_drop_seconds: float | None = None
    # The next this-many watches that resume from a resourceVersion get 410 Gone ("too old
    # resource version"), as after etcd compaction: the client must list again.
    expire_watches: int = 0
    gc_delay_seconds: float = 0.0
    watch_delay_seconds: dict[str, float] = field(default_factory=dict)  # plural -> seconds
    user_agent_prefix: str = OPERATOR_USER_AGENT
    injected: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, kind)
    # Targeted faults: "METHOD path-suffix" → [kind, times left]; for POST the suffix is
    # matched against "<collection>/<name of the posted object>".
    scripted: dict[str, list[Any]] = field(default_factory=dict)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def fail_next(self, method: str, path_suffix: str, times: int = 1,
                  kind: str = "before-500") -> None:
        self.scripted[f"{method} {path_suffix}"] = [kind, times]

    def draw(self, request: rendering.Request) -> str | None:
        """None (serve normally), 'before-500', 'before-409' or 'after-500'."""
        method = str(request.method.value)
        if method not in WRITE_METHODS or not request.headers.get(
                "User-Agent", "").startswith(self.user_agent_prefix):
            return None
        path = request.url.path
        if method == "POST" and isinstance(request.data, dict):
            path += "/" + str((request.data.get("metadata") or {}).get("name"))
        for target, script in self.scripted.items():
            t_method, suffix = target.split(" ", 1)
            if t_method == method and path.endswith(suffix) and script[1] > 0:
                script[1] -= 1
                self.injected.append((method, path, script[0]))
                return str(script[0])
        if self.write_error_fraction <= 0 or self._rng.random() >= self.write_error_fraction:
            return None
        kind = self._rng.choice(("before-500", "before-409", "after-500"))
        self.injected.append((method, path, kind))
        return kind


def injected_error(kind: str) -> Exception:
    if kind == "before-409":
        return _error(409, "Conflict", "injected: the object has been modified; please apply "
                      "your changes to the latest version and try again")
    return _error(500, "InternalError", f"injected ({kind}): etcdserver: request timed out")


class FaultVerbs:
    __slots__ = ()  # a mixin of an attrs-slotted class

    # ---- garbage collection --------------------------------------------------------------
    def _collect_dependents(self, uid: str, orphan: bool, later: bool = False) -> None:
        """Dependents of the owner `uid` (now gone): deleted, or with `orphan` freed of it;
        `later`: not within this call even without a delay (a create in progress)."""
        if orphan:
            for dep_key, dep in list(self._store.items()):
                owners = dep["metadata"].get("ownerReferences") or []
                kept = [o for o in owners if o.get("uid") != uid]
                if len(kept) != len(owners):
                    dep = copy.deepcopy(dep)
                    if kept:
                        dep["metadata"]["ownerReferences"] = kept
                    else:
                        dep["metadata"].pop("ownerReferences", None)
                    self._bump(dep)
                    self._store[dep_key] = dep
                    self._publish(dep_key, "MODIFIED", dep)
            return
        delay = self.faults.gc_delay_seconds
        if delay > 0 or later:
            asyncio.get_running_loop().call_later(delay, self._collect_now, uid)
        else:
            self._collect_now(uid)

    def _collect_now(self, uid: str) -> None:
        live = {o["metadata"]["uid"] for o in self._store.values()}
        for dep_key, dep in list(self._store.items()):
            owners = dep["metadata"].get("ownerReferences") or []
            if (dep_key in self._store and any(o.get("uid") == uid for o in owners)
                    and not any(o.get("uid") in live for o in owners)):
                self._delete(dep_key, grace_seconds=0)

    # ---- graceful pod deletion -----------------------------------------------------------
    @staticmethod
    def _runs_on_a_node(obj: dict[str, Any]) -> bool:
        phase = (obj.get("status") or {}).get("phase")
        return phase not in ("Succeeded", "Failed") and (
            bool((obj.get("spec") or {}).get("nodeName")) or phase == "Running")

    def _terminate_gracefully(self, key: ObjKey, grace_seconds: float | None) -> dict[str, Any]:
        obj = copy.deepcopy(self._store[key])
        if obj["metadata"].get("deletionTimestamp"):
            return obj  # already terminating: a second DELETE changes nothing here
        grace = grace_seconds if grace_seconds is not None else (
            obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        obj["metadata"]["deletionTimestamp"] = server_time(self.clock_skew_seconds)
        obj["metadata"]["deletionGracePeriodSeconds"] = int(grace)
        self._bump(obj)
        self._store[key] = obj
        self._publish(key, "MODIFIED", obj)
        stop = min(float(grace), self.kubelet_stop_seconds)
        asyncio.get_running_loop().call_later(stop, self._kubelet_stopped, key,
                                              obj["metadata"]["uid"])
        return copy.deepcopy(obj)

    def _kubelet_stopped(self, key: ObjKey, uid: str) -> None:
        """SIGTERM handled (exit 143), status reported, pod object removed (grace 0)."""
        obj = self._store.get(key)
        if obj is None or obj["metadata"]["uid"] != uid:
            return
        obj = copy.deepcopy(obj)
        status = obj.setdefault("status", {})
        status["phase"] = "Failed"
        now = server_time(self.clock_skew_seconds)
        for cs in status.get("containerStatuses") or []:
            cs["state"] = {"terminated": {"exitCode": TERMINATED_BY_SIGTERM, "reason": "Error",
                                          "startedAt": now, "finishedAt": now}}
            cs["ready"] = False
        self._bump(obj)
        self._store[key] = obj
        self._publish(key, "MODIFIED", obj)
        if not obj["metadata"].get("finalizers"):
            self._remove(key)

    def _evict(self, request: rendering.Request) -> dict[str, Any]:
        """POST pods/<name>/eviction: a DisruptionTarget condition, then graceful deletion
        (PodDisruptionBudgets are not emulated: every eviction is allowed)."""
        key = self._key(request)
        pod = copy.deepcopy(self._get(key))
        status = pod.setdefault("status", {})
        status["conditions"] = [c for c in status.get("conditions") or []
                                if c.get("type") != "DisruptionTarget"] + [{
            "type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
            "lastTransitionTime": server_time(self.clock_skew_seconds)}]
        self._bump(pod)
        self._store[key] = pod
        self._publish(key, "MODIFIED", pod)
        options = (request.data or {}).get("deleteOptions") or {}
        grace = options.get("gracePeriodSeconds")
        self._delete(key, grace_seconds=None if grace is None else float(grace))
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def _check_preconditions(self, key: ObjKey, body: dict[str, Any]) -> None:
        pre = body.get("preconditions") or {}
        meta = self._store[key]["metadata"]
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise _error(409, "Conflict", f"Precondition failed: UID in precondition: "
                         f"{pre['uid']}, UID in object meta: {meta['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise _error(409, "Conflict", "Precondition failed: resourceVersion in precondition: "
                         f"{pre['resourceVersion']}, in object meta: {meta['resourceVersion']}")

    async def _serve_delete(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request)
        self._get(key)
        body = request.data if isinstance(request.data, dict) else {}
        self._check_preconditions(key, body)
        policy = body.get("propagationPolicy") or request.params.get("propagationPolicy")
        grace = body.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
        grace_seconds = None if grace is None else float(grace)
        if policy == "Orphan":
            obj = self._store[key]
            if not obj["metadata"].get("finalizers"):
                snapshot = copy.deepcopy(obj)
                self._remove(key, orphan=True)
                return snapshot
            if "orphan" not in obj["metadata"]["finalizers"]:  # the GC frees the dependents
                obj = copy.deepcopy(obj)  # once every other finalizer is gone
                obj["metadata"]["finalizers"].append("orphan")
                self._store[key] = obj
        return self._delete(key, grace_seconds=grace_seconds)
