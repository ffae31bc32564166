"""A Kubernetes API emulator for operator tests: kmock's KubernetesEmulator with the gaps closed.

kmock 0.8 serves objects over real HTTP but (measured, see k8s-testing-notes.md) stamps no
resourceVersion/uid/timestamps, replays every object as ADDED on each watch, ignores label
selectors and the status subresource, never garbage-collects dependents and fails on
`/api/v1/namespaces`. This subclass keeps kmock's HTTP server, request parsing, discovery and
DSL (so a test can still inject faults with `emulator['post …'] << 500`) and replaces the
object store behind the default handlers with one that behaves like a kube-apiserver in the
ways an operator can observe:

* every write stamps `uid`, `resourceVersion` (one global counter), `creationTimestamp`,
  `generation` (bumped only when something outside metadata/status changes), `generateName`;
* watches honour `resourceVersion` (replay from an event log, then live, atomically: all
  mutations are synchronous in one event loop, so no event can fall between the two),
  `labelSelector`, `fieldSelector`, `timeoutSeconds`, `sendInitialEvents`; 410 when too old;
* status-subresource rules: the main URL ignores `status`, `/status` ignores everything else;
  create resets the status of custom resources and pods (`phase: Pending`), as the real one;
* optimistic concurrency on `metadata.resourceVersion` in PATCH/PUT bodies (409);
* merge, JSON and strategic-merge patches, PUT, finalizers, ownerReference cascading GC;
* `/api/v1/namespaces` (namespaces are objects; created on first use);
* pod logs (`GET pods/NAME/log`, `follow`; kube_logs.py), written by the test's kubelet;
* every request is recorded (`calls`) for "nothing created twice" and RBAC-coverage checks.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering
from kube_faults import Faults, FaultVerbs, injected_error, server_time
from kube_logs import LogVerbs, PodLogs
from kube_selectors import ObjKey, match_fields, match_labels, paginate
from kube_selectors import api_error as _error
from kube_writes import WriteVerbs

_NAMESPACES_PATH = re.compile(r"/api/v1/namespaces(?:/(?P<name>[^/]+))?/?")
_LOG_RETENTION = 200_000  # events kept for watch replay; older resourceVersions get 410 Gone


@dataclass(frozen=True)
class ApiCall:
    """A request as RBAC sees it: verb, group, resource[/subresource], namespace ('' = cluster)."""

    verb: str
    group: str
    resource: str
    namespace: str
    name: str | None
    status: int
    user_agent: str = ""
    committed: bool = False  # the write took effect (even when its reply was an injected 500)
    label_selector: str = ""  # of a list or watch: what the client asked the server to filter


def _forbidden(call: ApiCall) -> kmock.KubernetesError:
    plural, _, sub = call.resource.partition("/")
    what = f"{plural}.{call.group}" if call.group else plural
    where = f' in the namespace "{call.namespace}"' if call.namespace else " at the cluster scope"
    resource = f'"{plural}"' + (f' with subresource "{sub}"' if sub else "")
    return _error(403, "Forbidden", f'{what} is forbidden: User "tester" cannot {call.verb} '
                  f'resource {resource} in API group "{call.group}"{where}')


@attrs.define(kw_only=True)
class ApiEmulator(FaultVerbs, WriteVerbs, LogVerbs, kmock.KubernetesEmulator):
    calls: list[ApiCall] = attrs.field(factory=list, init=False)
    faults: Faults = attrs.field(factory=Faults, init=False)  # tests replace it to inject
    kubelet_stop_seconds: float = attrs.field(default=0.2, init=False)  # SIGTERM → exit 143
    clock_skew_seconds: float = attrs.field(default=0.0, init=False)  # server clock vs ours
    kubeconfig: Any = attrs.field(default=None, init=False)  # set by the test fixture
    # RBAC denials, as (verb, resource[/sub]): answered 403 as the real authorizer words it
    forbidden: set[tuple[str, str]] = attrs.field(factory=set, init=False)
    # Mutating admission of pods at create (e.g. Kueue's webhook: kueue_emulator.py) and
    # callbacks after every stored change (controllers emulated in the test's event loop).
    pod_webhooks: list[Callable[[dict[str, Any]], None]] = attrs.field(factory=list, init=False)
    on_change: list[Callable[[ObjKey, str, dict[str, Any]], None]] = attrs.field(
        factory=list, init=False)
    _store: dict[ObjKey, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _logs: PodLogs = attrs.field(factory=PodLogs, init=False)
    _log: list[tuple[int, str, str, str, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: list[tuple[str, str, asyncio.Queue[Any]]] = attrs.field(factory=list, init=False)
    _rv: int = attrs.field(default=1000, init=False)
    _names: int = attrs.field(default=0, init=False)
    _builtin_payloads: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # registers self._serve_* (our overrides) as fallbacks
        self.resources.load_bundled()
        self.fallback[kmock.method.PUT] << self._serve_put  # kmock guesses no action for PUT
        self._builtin_payloads = len(self._payloads)

    # ---- public helpers for tests ---------------------------------------------------------
    def add_resource(self, group: str, version: str, plural: str, kind: str, *,
                     namespaced: bool = True, status: bool = True, shortnames: tuple = ()) -> None:
        """Declare a custom resource (what applying its CRD does)."""
        self.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=kind.lower(), shortnames=set(shortnames),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources={"status"} if status else set())

    def replace_object(self, key: ObjKey, obj: dict[str, Any]) -> None:
        """Store a new version of an existing object (a controller's write), watchers told."""
        self._bump(obj)
        self._store[key] = obj
        self._publish(key, "MODIFIED", obj)

    def list_objects(self, plural: str, namespace: str | None = None, group: str = "",
                     where: Callable[[dict[str, Any]], bool] | None = None
                     ) -> list[dict[str, Any]]:
        """Copies of the stored objects of one resource (in one namespace), in key order.
        `where` picks among the stored objects (read, never changed) before any is copied:
        the tests poll these helpers, and copying every pod of every job on each poll was
        most of a long test's own CPU time (the fault soak's: 20 jobs' pods, 50 times a
        second)."""
        found = [(key, o) for key, o in self._store.items()
                 if key[0] == group and key[1] == plural
                 and (namespace is None or key[2] == namespace) and (where is None or where(o))]
        return [copy.deepcopy(o) for _, o in sorted(found, key=lambda kv: str(kv[0]))]

    def history(self, plural: str, namespace: str | None, name: str,
                group: str = "") -> list[dict[str, Any]]:
        """Every version of one object, oldest first (from the watch event log)."""
        return [copy.deepcopy(obj) for _, g, p, kind, obj in self._log
                if (g, p) == (group, plural) and kind != "BOOKMARK"
                and obj["metadata"].get("namespace") == namespace
                and obj["metadata"]["name"] == name]

    def created(self, plural: str, group: str = "") -> Counter[tuple[str, str]]:
        """Creations that took effect per (namespace, name): a count > 1 means created twice
        (a create whose reply was lost to an injected fault counts: the object exists)."""
        return Counter((c.namespace, c.name or "") for c in self.calls
                       if c.verb == "create" and c.resource == plural and c.group == group
                       and c.committed)

    def rbac_rules(self, *, include_tests: bool = True) -> set[tuple[str, str, str, str]]:
        """(verb, apiGroup, resource[/sub], namespace or '') for every request served;
        without the test's own requests (kmock's client, cephalo.client's) when include_tests
        is False."""
        return {(c.verb, c.group, c.resource, c.namespace) for c in self.calls
                if include_tests or not c.user_agent.startswith(("kmock/", "cephalo-client/"))}

    # ---- request plumbing ----------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        m = _NAMESPACES_PATH.fullmatch(raw_request.path)
        if m is None:  # kmock's path parser fails on the namespaces endpoint itself
            return await super().__call__(raw_request)
        body = await raw_request.read()
        method = raw_request.method.upper()
        params = dict(raw_request.query)
        action = (kmock.action.WATCH if params.get("watch") == "true" else
                  {"POST": kmock.action.CREATE, "PATCH": kmock.action.UPDATE,
                   "DELETE": kmock.action.DELETE}.get(method)
                  or (kmock.action.FETCH if m["name"] else kmock.action.LIST))
        request = rendering.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=method,
            params=params, headers=dict(raw_request.headers), body=body, text=body.decode(),
            data=json.loads(body) if body else None, action=action,
            resource=kmock.resource("", "v1", "namespaces"), namespace=None, name=m["name"])
        self._requests.append(request)
        try:
            return await self._handle(request)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: it mutates kmock's own store before dispatching.
        # Record first: a watch only returns when its stream ends.
        index = self._record(request)
        status, committed = 200, False
        fault = self.faults.draw(request) if index is not None else None
        try:
            if fault is not None and fault.startswith("before"):
                raise injected_error(fault)
            if index is not None and (call := self.calls[index]).verb and (
                    call.verb, call.resource) in self.forbidden:
                raise _forbidden(call)
            if request.subresource == "log" and request.method == kmock.method.GET:
                return await self._serve_log(request)
            if len(self._payloads) == self._builtin_payloads and request.resource is not None \
                    and request.resource.plural:
                response = await self._serve_directly(request)
            else:
                response = await super(kmock.KubernetesEmulator, self)._handle(request)
            committed = True
            if fault is not None:  # it took effect, but the client never hears so
                raise injected_error(fault)
            return response
        except kmock.KubernetesError as exc:
            status = exc.status
            raise
        finally:
            if index is not None:
                self.calls[index] = dataclasses.replace(self.calls[index], status=status,
                                                        committed=committed)

    async def _serve_directly(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """Our handlers without kmock's DSL routing, which re-filters every past request on
        each new one (quadratic: the load benchmark spent 80% of its time there). Used while
        a test has added no reactions of its own."""
        if request.action == kmock.action.WATCH:
            raw = request._raw_request
            assert raw is not None
            response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(raw)
            async for event in self._serve_watch(request):
                if event != b"":
                    await response.write(json.dumps(event).encode() + b"\n")
            return response
        handler = {kmock.action.LIST: self._serve_list, kmock.action.FETCH: self._serve_fetch,
                   kmock.action.CREATE: self._serve_create, kmock.action.UPDATE: self._serve_update,
                   kmock.action.DELETE: self._serve_delete}.get(request.action)
        if handler is None and request.method == kmock.method.PUT:
            handler = self._serve_put
        if request.method == kmock.method.POST and request.subresource == "eviction":
            handler = self._serve_create  # kmock sees no action in a POST to a named object
        if handler is None:
            raise _error(405, "MethodNotAllowed", f"{request.method} {request.url.path}")
        created = request.action == kmock.action.CREATE
        return aiohttp.web.json_response(await handler(request), status=201 if created else 200)

    def _record(self, request: rendering.Request) -> int | None:
        res = request.resource
        if res is None or not res.plural:
            return None
        method = str(request.method.value)
        verb = {"GET": "list" if request.name is None else "get", "POST": "create",
                "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method)
        if request.params.get("watch") in ("true", "1"):
            verb = "watch"
        plural = res.plural + (f"/{request.subresource}" if request.subresource else "")
        name = request.name
        if name is None and verb == "create" and isinstance(request.data, dict):
            name = (request.data.get("metadata") or {}).get("name")
        self.calls.append(ApiCall(verb, res.group or "", plural, request.namespace or "", name,
                                  0, request.headers.get("User-Agent", ""),
                                  label_selector=request.params.get("labelSelector", "")))
        return len(self.calls) - 1

    # ---- store ---------------------------------------------------------------------------
    def _info(self, request: rendering.Request) -> kmock.ResourceInfo:
        res = request.resource
        for known in self._get_resources():
            if known == res:
                return self.resources[known]
        raise _error(404, "NotFound", f"the server could not find the requested resource {res}")

    def _key(self, request: rendering.Request, name: str | None = None) -> ObjKey:
        info = self._info(request)
        ns = request.namespace if info.namespaced else None
        if info.namespaced and ns is None and request.action not in (kmock.action.LIST,
                                                                   kmock.action.WATCH):
            raise _error(400, "BadRequest", "a namespaced resource needs a namespace in the URL")
        return (request.resource.group or "", request.resource.plural, ns, name or request.name)

    def _publish(self, key: ObjKey, kind: str, obj: dict[str, Any]) -> None:
        entry = (int(obj["metadata"]["resourceVersion"]), key[0], key[1], kind, copy.deepcopy(obj))
        self._log.append(entry)
        del self._log[:-_LOG_RETENTION]
        delay_seconds = self.faults.watch_delay_seconds.get(key[1], 0.0)
        for group, plural, queue in self._watchers:
            if (group, plural) == key[:2]:
                if delay_seconds > 0:  # in order: every event of the resource waits as long
                    asyncio.get_running_loop().call_later(delay_seconds, queue.put_nowait, entry)
                else:
                    queue.put_nowait(entry)
        for callback in self.on_change:
            callback(key, kind, obj)

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    def _ensure_namespace(self, namespace: str | None) -> None:
        key = ("", "namespaces", None, namespace or "")
        if namespace and key not in self._store:
            self._insert(key, {"apiVersion": "v1", "kind": "Namespace",
                               "metadata": {"name": namespace}, "status": {"phase": "Active"}})

    def _insert(self, key: ObjKey, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta.update(name=key[3], uid=str(uuid.uuid4()),
                    creationTimestamp=server_time(self.clock_skew_seconds), generation=1)
        if key[2] is not None:
            meta["namespace"] = key[2]
        meta.pop("deletionTimestamp", None)
        self._bump(obj)
        self._store[key] = obj
        self._publish(key, "ADDED", obj)
        owners = {o.get("uid") for o in meta.get("ownerReferences") or []}
        live = {o["metadata"]["uid"] for o in self._store.values()}
        if owners and not owners & live:  # every owner already gone: the GC collects it too
            self._collect_dependents(next(iter(owners)), orphan=False, later=True)
        return obj

    def _remove(self, key: ObjKey, orphan: bool = False) -> None:
        obj = self._store.pop(key)
        self._bump(obj)
        self._publish(key, "DELETED", obj)
        # Background propagation: the GC removes (or, for Orphan, frees) the dependents.
        self._collect_dependents(obj["metadata"]["uid"], orphan)

    def _delete(self, key: ObjKey, grace_seconds: float | None = None) -> dict[str, Any]:
        obj = self._store[key]
        if key[:2] == ("", "pods") and grace_seconds != 0 and self._runs_on_a_node(obj):
            return self._terminate_gracefully(key, grace_seconds)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = server_time(self.clock_skew_seconds)
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                self._bump(obj)
                self._publish(key, "MODIFIED", obj)
            return copy.deepcopy(obj)
        snapshot = copy.deepcopy(obj)
        self._remove(key)
        return snapshot

    def _get(self, key: ObjKey) -> dict[str, Any]:
        if key not in self._store:
            raise _error(404, "NotFound", f'{key[1]} "{key[3]}" not found')
        return self._store[key]

    # ---- verbs ---------------------------------------------------------------------------
    async def _serve_create(self, request: rendering.Request) -> dict[str, Any]:
        if request.subresource == "eviction" and request.resource.plural == "pods":
            return self._evict(request)  # kubectl drain, the Eviction API
        obj = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if obj is None:
            raise _error(400, "BadRequest", "create needs a JSON object body")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            self._names += 1
            meta["name"] = f"{meta['generateName']}{self._names:05x}"
        info = self._info(request)
        if meta.get("namespace") and meta["namespace"] != request.namespace and info.namespaced:
            raise _error(400, "BadRequest", "the namespace of the object does not match the URL")
        key = self._key(request, meta["name"])
        if key in self._store:
            raise _error(409, "AlreadyExists", f'{key[1]} "{key[3]}" already exists')
        obj.setdefault("kind", info.kind)
        group = request.resource.group
        obj.setdefault("apiVersion", f"{group}/{request.resource.version}" if group else "v1")
        if key[:2] == ("", "pods"):
            for webhook in self.pod_webhooks:
                webhook(obj)
            obj["status"] = {"phase": "Pending"}
            if (obj.get("spec") or {}).get("schedulingGates"):
                # What the scheduler reports for a gated pod: it is not even tried.
                obj["status"]["conditions"] = [{
                    "type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
                    "message": "Scheduling is blocked due to non-empty scheduling gates"}]
        elif group and "status" in info.subresources:
            obj.pop("status", None)
        self._ensure_namespace(key[2])
        return copy.deepcopy(self._insert(key, obj))

    async def _serve_fetch(self, request: rendering.Request) -> dict[str, Any]:
        return copy.deepcopy(self._get(self._key(request)))

    async def _serve_list(self, request: rendering.Request) -> dict[str, Any]:
        info = self._info(request)
        group, plural, ns, _ = self._key(request, "-")
        items = [copy.deepcopy(o) for (g, p, n, _), o in self._store.items()
                 if (g, p) == (group, plural) and (ns is None or n == ns)
                 and self._selected(request, o)]
        items, more = paginate(items, request.params.get("limit"),
                               request.params.get("continue"))
        version = request.resource.version
        return {"apiVersion": f"{group}/{version}" if group else version,
                "kind": f"{info.kind}List",
                "metadata": {"resourceVersion": str(self._rv), **more}, "items": items}

    def _selected(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        try:
            return (match_labels(request.params.get("labelSelector", ""),
                                 obj["metadata"].get("labels") or {})
                    and match_fields(request.params.get("fieldSelector", ""), obj))
        except ValueError as err:
            raise _error(400, "BadRequest", str(err)) from None

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        group, plural, ns, name = self._key(request, None)
        since = request.params.get("resourceVersion", "")
        timeout_seconds = float(request.params.get("timeoutSeconds") or 0) or None
        if self.faults.watch_drop_seconds is not None:  # the server closes streams early
            timeout_seconds = min(timeout_seconds or float("inf"), self.faults.watch_drop_seconds)
        # Snapshot and subscription happen with no await in between: no event can be lost.
        queue: asyncio.Queue[Any] = asyncio.Queue()
        if since in ("", "0"):
            backlog = [(0, group, plural, "ADDED", copy.deepcopy(o))
                       for (g, p, _, _), o in self._store.items() if (g, p) == (group, plural)]
        else:
            oldest = self._log[0][0] if self._log else self._rv
            expired = self.faults.expire_watches > 0
            self.faults.expire_watches -= expired
            if expired or (int(since) < oldest - 1 and len(self._log) >= _LOG_RETENTION):
                yield b""
                yield {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                   "reason": "Expired", "status": "Failure",
                                                   "message": f"too old resource version: {since}"}}
                return
            backlog = [e for e in self._log if e[0] > int(since) and e[1:3] == (group, plural)]
        watcher = (group, plural, queue)
        self._watchers.append(watcher)
        for entry in backlog:
            queue.put_nowait(entry)
        if request.params.get("sendInitialEvents") == "true":
            queue.put_nowait((self._rv, group, plural, "BOOKMARK", {
                "kind": "Bookmark", "metadata": {"resourceVersion": str(self._rv), "annotations": {
                    "k8s.io/initial-events-end": "true"}}}))
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        try:
            yield b""  # send the headers now, even if no event comes
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    _, _, _, kind, obj = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    return
                meta = obj.get("metadata", {})
                if kind != "BOOKMARK" and (
                        (ns is not None and meta.get("namespace") != ns)
                        or (name is not None and meta.get("name") != name)
                        or not self._selected(request, obj)):
                    continue
                yield {"type": kind, "object": obj}
        finally:
            self._watchers.remove(watcher)
