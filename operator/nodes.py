"""One shared view of the cluster's nodes, kept current by kopf's node watch.

Every reconcile pass needs the GPU pools. Listing `/api/v1/nodes` per pass made node events
cost jobs x nodes (1000 nodes: 10.5 MB per LIST, once per active job per node event). Instead
the node watch (handlers.node_changed) feeds every event into one `NodeView`, and a pass
reads the view. The view keeps only what discovery reads (`slim`): node heartbeats, images
and addresses neither cost memory nor count as changes.

A watch is not a complete record, so the view falls back to one LIST (shared by every pass
waiting at that moment) when it has not been primed, when kopf re-lists (after a 410 Gone its
re-list sends the current objects but no DELETED events for what went in the gap) and after
`resync_seconds` without a LIST (a stalled watch must not leave a view stale forever), and for
a job's first pass (a node that joined just before the job may not have reached the watch:
FRESH_SHARE_SECONDS). Events
that arrive while that LIST is in flight are replayed on top of it when their
resourceVersion is newer than the listed object's, so a LIST never rolls the view back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from cephalo.operator.discovery import GPU_RESOURCE, PRODUCT_LABEL, discover_pools
from cephalo.operator.kube import core_path

# Initial-listing events (kopf's type None) further apart than this start a new listing.
RELIST_GAP_SECONDS = 2.0
# A job's first pass plans from a LIST (`nodes(fresh=True)`): a node that joined just before
# the job was created may not have reached the watch yet (a real control plane under load:
# a job submitted right after two nodes turned Ready was planned on one of them). First
# passes within this many seconds of a LIST share it, so a burst of new jobs costs one LIST a
# second, not one per job.
FRESH_SHARE_SECONDS = 1.0


class NodeLister(Protocol):
    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        ...


def slim(node: dict[str, Any]) -> dict[str, Any]:
    """The parts of a Node that discovery reads (discovery.discover_pools, select_cluster)."""
    meta, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
    out: dict[str, Any] = {
        "metadata": {"name": meta["name"], "labels": dict(meta.get("labels") or {}),
                     "resourceVersion": meta.get("resourceVersion")},
        "spec": {}, "status": {"allocatable": {}, "conditions": []}}
    if spec.get("unschedulable"):
        out["spec"]["unschedulable"] = True
    if spec.get("taints"):
        # key, value and effect: what toleration matching reads (discovery.tolerates)
        out["spec"]["taints"] = [{k: t[k] for k in ("key", "value", "effect") if k in t}
                                 for t in spec["taints"]]
    gpus = (status.get("allocatable") or {}).get(GPU_RESOURCE)
    if gpus is not None:
        out["status"]["allocatable"][GPU_RESOURCE] = gpus
    out["status"]["conditions"] = [{"type": "Ready", "status": c.get("status")}
                                   for c in status.get("conditions") or []
                                   if c.get("type") == "Ready"]
    return out


def _content(node: dict[str, Any] | None) -> Any:
    """A slim node without its resourceVersion: equal content means nothing discovery reads
    changed."""
    if node is None:
        return None
    return {**node, "metadata": {k: v for k, v in node["metadata"].items()
                                 if k != "resourceVersion"}}


def _newer(version: str | None, than: str | None) -> bool:
    """Is resourceVersion `version` newer than `than`? Kubernetes calls them opaque, yet every
    real server (etcd revisions) and the emulator issue integers; when one is not an integer,
    trust the event (it arrived after the LIST was asked for)."""
    try:
        return int(version or "") > int(than or "")
    except ValueError:
        return True


def _product(node: dict[str, Any] | None) -> str | None:
    return None if node is None else (node["metadata"].get("labels") or {}).get(PRODUCT_LABEL)


class NodeView:
    """Slim nodes by name; `apply` for watch events, `nodes` for readers."""

    def __init__(self, resync_seconds: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.resync_seconds = resync_seconds
        self.clock = clock
        self.num_lists = 0  # full LISTs made (benchmarks and tests count them)
        self._nodes: dict[str, dict[str, Any]] = {}
        self._listed_at: float | None = None  # None: never listed (not primed)
        self._stale = False
        self._last_initial_event = float("-inf")
        self._in_flight: dict[str, tuple[str, dict[str, Any]]] | None = None  # events during LIST
        self._lock = asyncio.Lock()

    def apply(self, event_type: str | None, node: dict[str, Any]) -> set[str]:
        """One watch event (type None: kopf's listing). Returns the GPU products whose pools it
        may change: empty when nothing discovery reads changed (heartbeats) or for CPU nodes."""
        now = self.clock()
        if event_type is None:
            if now - self._last_initial_event > RELIST_GAP_SECONDS and self._listed_at is not None:
                self._stale = True  # a (re-)listing: DELETED events for its gap never come
            self._last_initial_event = now
        slim_node = slim(node)
        name = slim_node["metadata"]["name"]
        if self._in_flight is not None:
            self._in_flight[name] = (event_type or "MODIFIED", slim_node)
        old = self._nodes.get(name)
        if event_type == "DELETED":
            self._nodes.pop(name, None)
            new = None
        else:
            self._nodes[name] = new = slim_node
        if _content(old) == _content(new):
            return set()
        return {p for p in (_product(old), _product(new)) if p is not None}

    def pool_gpus(self) -> dict[str, int] | None:
        """Usable GPUs per pool as the view stands (no LIST); None before it is primed."""
        if self._listed_at is None:
            return None
        return {p.product: p.num_gpus for p in discover_pools(list(self._nodes.values())).pools}

    def needs_list(self) -> bool:
        return (self._listed_at is None or self._stale
                or self.clock() - self._listed_at > self.resync_seconds)

    async def nodes(self, kube: NodeLister, fresh: bool = False) -> list[dict[str, Any]]:
        """Every known node (slim), after one LIST if the view cannot be trusted as it is, or
        if `fresh` and no LIST started in the last FRESH_SHARE_SECONDS (a job's first plan)."""
        asked = self.clock()

        def must_list() -> bool:
            return self.needs_list() or (fresh and (
                self._listed_at is None or asked - self._listed_at > FRESH_SHARE_SECONDS))

        if must_list():
            async with self._lock:  # passes waiting here share the LIST the first one makes
                if must_list():
                    await self._relist(kube)
        return list(self._nodes.values())

    async def _relist(self, kube: NodeLister) -> None:
        self._in_flight = {}
        self._stale = False  # a listing that starts during our LIST marks it stale again
        started = self.clock()
        try:
            items = await kube.list(core_path(None, "nodes"))
            self.num_lists += 1
            listed = {n["metadata"]["name"]: slim(n) for n in items}
            for name, (event_type, node) in self._in_flight.items():
                version = node["metadata"].get("resourceVersion")
                base = listed.get(name)
                if base is not None and not _newer(version, base["metadata"].get(
                        "resourceVersion")):
                    continue  # the LIST saw this change or a later one
                if event_type == "DELETED":
                    listed.pop(name, None)
                else:
                    listed[name] = node
            self._nodes = listed
            self._listed_at = started
        except BaseException:
            self._stale = True
            raise
        finally:
            self._in_flight = None


# The operator's one view: fed by handlers.node_changed, read by reconcile.
NODES = NodeView()
