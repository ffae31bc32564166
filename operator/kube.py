"""The operator's only Kubernetes I/O besides kopf's own: a thin JSON client.

It uses the `kubernetes` client for configuration, authentication and the HTTP pool, but
asks for raw JSON (no model (de)serialisation: faster, and immune to models that reject
partial objects). The client is synchronous, so every call runs in a worker thread
(`asyncio.to_thread`): kopf's event loop never blocks on the network.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote

import kubernetes

from cephalo.api import API_GROUP, API_VERSION, PLURAL

REQUEST_TIMEOUT_SECONDS = 30
# API calls block on the network, not the CPU: more threads than asyncio's default
# (cores + 4) keep 100 jobs' reconciles from queueing behind each other.
IO_THREADS = 32
MERGE_PATCH = "application/merge-patch+json"
# LIST in pages (`limit` + `continue`), as kubectl and client-go's pager do: a cluster's
# pods are tens of thousands, and one unbounded LIST is one huge reply for the API server to
# build and for the operator to hold.
LIST_PAGE_SIZE = 500
T = TypeVar("T")


def controller_uid(obj: dict[str, Any]) -> str | None:
    """The uid in the object's controller ownerReference (None: no controller)."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """A child counts for a job only when its controller is *this* job: same uid. A job
    deleted and created again under the same name has a new uid; the old job's children
    (kept a while by a lagging garbage collector, or orphaned on purpose) are not its own."""
    return controller_uid(obj) == uid


class NotOwned(Exception):
    """A child name is taken by an object that is not this job's (an older job's, being
    removed): it was deleted, and the pass waits for it to go instead of adopting it."""


def not_owned(obj: dict[str, Any]) -> NotOwned:
    """What to raise after deleting `obj`, a namesake of one of our children (its uid is the
    delete's precondition, so a namesake created since is never hit)."""
    return NotOwned(f"{obj.get('kind', 'object')} {obj['metadata']['name']} belongs to another "
                    f"owner (uid {controller_uid(obj)}); deleted it, waiting for it to go")


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason


def load_api_client() -> kubernetes.client.ApiClient:
    """In-cluster service account when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    configuration = kubernetes.client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = IO_THREADS
    return kubernetes.client.ApiClient(configuration)


def core_path(namespace: str | None, plural: str, name: str | None = None,
              subresource: str | None = None) -> str:
    path = "/api/v1" + (f"/namespaces/{quote(namespace)}" if namespace else "") + f"/{plural}"
    return path + (f"/{quote(name)}" if name else "") + (f"/{subresource}" if subresource else "")


def job_path(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    path = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{quote(namespace)}/{PLURAL}"
    return path + (f"/{quote(name)}" if name else "") + (f"/{subresource}" if subresource else "")


class Kube:
    """Synchronous JSON calls; see AsyncKube for the event-loop-safe wrapper."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api

    def request(self, method: str, path: str, body: Any = None,
                query: dict[str, str] | None = None,
                content_type: str = "application/json",
                timeout_seconds: float = REQUEST_TIMEOUT_SECONDS) -> dict[str, Any]:
        method, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(method, url, header_params=headers, body=body,
                                     _request_timeout=timeout_seconds)
        response.read()
        text = response.data.decode(errors="replace") if response.data else ""
        if response.status >= 400:
            # A Status object, usually; but the API server answers a path that no API group
            # serves with a text/plain "404 page not found", and a proxy may answer in HTML.
            try:
                status = json.loads(text) if text else {}
            except ValueError:
                status = {}
            status = status if isinstance(status, dict) else {}
            raise ApiError(response.status, str(status.get("reason") or response.reason),
                           str(status.get("message") or text.strip()[:200]))
        return json.loads(text) if text else {}

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None,
             keep: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
             ) -> list[dict[str, Any]]:
        """Every object at `path` (which may carry its own query, e.g. a fieldSelector), read
        in pages of LIST_PAGE_SIZE. `keep` maps each object to what the caller keeps (None:
        drop it), page by page, so a large cluster's objects are never all held at once. A
        continue token that expired (410 Gone) starts the LIST again, as client-go does."""
        base, _, query_string = path.partition("?")
        query = dict(parse_qsl(query_string))
        if label_selector:
            query["labelSelector"] = label_selector
        query["limit"] = str(LIST_PAGE_SIZE)
        items: list[dict[str, Any]] = []
        while True:
            try:
                page = self.request("GET", base, query=query)
            except ApiError as err:
                if err.status != 410 or "continue" not in query:
                    raise
                query.pop("continue")
                items = []
                continue
            for obj in page.get("items") or []:
                kept = obj if keep is None else keep(obj)
                if kept is not None:
                    items.append(kept)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query["continue"] = token

    def create(self, path: str, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create-if-absent: (object, True) when created, (existing, False) on 409."""
        try:
            return self.request("POST", path, body=obj), True
        except ApiError as err:
            if err.status != 409:
                raise
        existing = self.get(f"{path}/{quote(obj['metadata']['name'])}")
        if existing is None:  # deleted between our POST and GET: let the next pass retry
            raise ApiError(409, "Conflict", f"{obj['metadata']['name']} is being replaced")
        return existing, False

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.request("PATCH", path, body=patch, content_type=MERGE_PATCH)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def delete(self, path: str, uid: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone. With `uid`, only
        that very object (a precondition): never a namesake created since it was read."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", path, body=body)
            return True
        except ApiError as err:
            if err.status == 404 or (err.status == 409 and uid is not None):
                return False  # gone, or replaced by a namesake: either way not ours to delete
            raise


class AsyncKube:
    """Every Kube call in a worker thread, awaitable from kopf handlers."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kube")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self._run(self.kube.get, path)

    async def list(self, path: str, label_selector: str | None = None,
                   keep: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
                   ) -> list[dict[str, Any]]:
        return await self._run(self.kube.list, path, label_selector, keep)

    async def create(self, path: str, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        return await self._run(self.kube.create, path, obj)

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        return await self._run(self.kube.patch, path, patch)

    async def delete(self, path: str, uid: str | None = None) -> bool:
        return await self._run(self.kube.delete, path, uid)


