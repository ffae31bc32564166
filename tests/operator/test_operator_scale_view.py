"""The shared node view and node-event wake-ups, without a cluster (cephalo.operator.nodes).

A LIST is counted by a lister that awaits (so concurrent readers really overlap) and returns
copies of what the test says the API server holds at that moment.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from kube_fixtures import cluster_a, gpu_node

from cephalo.operator import handlers
from cephalo.operator.discovery import discover_pools
from cephalo.operator.nodes import FRESH_SHARE_SECONDS, RELIST_GAP_SECONDS, NodeView, slim


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lister:
    """The API server's nodes as of each LIST; `during` runs while a LIST is in flight."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.calls = 0
        self.during: Any = None
        self.fail = False

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        assert path == "/api/v1/nodes" and label_selector is None
        self.calls += 1
        snapshot = copy.deepcopy(list(self.nodes.values()))
        await asyncio.sleep(0.01)  # the reply is on the wire: events may arrive meanwhile
        if self.during is not None:
            self.during()
        if self.fail:
            raise ConnectionError("apiserver down")
        return snapshot


def versioned(node: dict[str, Any], rv: int) -> dict[str, Any]:
    node = copy.deepcopy(node)
    node["metadata"]["resourceVersion"] = str(rv)
    return node


def names(nodes: list[dict[str, Any]]) -> list[str]:
    return sorted(n["metadata"]["name"] for n in nodes)


def test_slim_nodes_discover_the_same_pools_and_drop_the_rest() -> None:
    tainted = gpu_node("t", "Tesla-T4", 4)
    tainted["spec"]["taints"] = [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]
    nodes = [*cluster_a(), tainted, gpu_node("down", "NVIDIA-L4", 2, ready=False),
             gpu_node("cordoned", "NVIDIA-L4", 2, unschedulable=True)]
    for node in nodes:
        node["status"]["images"] = [{"names": ["x" * 200]}] * 50  # what real nodes carry
        node["status"]["conditions"].append({"type": "MemoryPressure", "status": "False",
                                             "lastHeartbeatTime": "2026-01-01T00:00:00Z"})
    assert discover_pools([slim(n) for n in nodes]) == discover_pools(nodes)
    assert all("images" not in slim(n)["status"] for n in nodes)


def test_events_report_the_products_whose_pools_may_change() -> None:
    view = NodeView()
    node = versioned(gpu_node("g", "NVIDIA-L4", 2), 1)
    assert view.apply("ADDED", node) == {"NVIDIA-L4"}
    beat = versioned(node, 2)
    beat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-01-01T00:00:10Z"
    assert view.apply("MODIFIED", beat) == set(), "a heartbeat changes no pool"
    relabelled = versioned(gpu_node("g", "Tesla-T4", 2), 3)
    assert view.apply("MODIFIED", relabelled) == {"NVIDIA-L4", "Tesla-T4"}
    assert view.apply("ADDED", versioned(gpu_node("cpu", None, 0), 4)) == set()
    assert view.apply("DELETED", relabelled) == {"Tesla-T4"}


@pytest.mark.asyncio
async def test_unprimed_view_lists_once_for_any_number_of_concurrent_readers() -> None:
    lister, view = Lister(cluster_a()), NodeView()
    assert view.pool_gpus() is None, "no view yet: callers must not trust it"
    results = await asyncio.gather(*(view.nodes(lister) for _ in range(50)))
    assert lister.calls == 1
    assert all(names(r) == names(cluster_a()) for r in results)
    assert view.pool_gpus() == {p.product: p.num_gpus for p in discover_pools(cluster_a()).pools}
    await view.nodes(lister)
    assert lister.calls == 1 and view.num_lists == 1, "primed: reads are free"


@pytest.mark.asyncio
async def test_a_jobs_first_plan_sees_a_node_the_watch_has_not_brought_yet() -> None:
    """A realk8s CI run: a job created right after two nodes turned Ready was planned on one
    of them (the operator's watch had not delivered the second). A fresh read LISTs, and a
    burst of them within FRESH_SHARE_SECONDS shares one LIST."""
    clock = Clock()
    lister, view = Lister(cluster_a()), NodeView(clock=clock)
    await view.nodes(lister)
    joined = gpu_node("joined", "NVIDIA-A10G", 2)
    lister.nodes["joined"] = joined  # on the API server; its watch event still on the way
    clock.now += FRESH_SHARE_SECONDS + 1
    assert "joined" not in names(await view.nodes(lister)), "a pass reads the view"
    results = await asyncio.gather(*(view.nodes(lister, fresh=True) for _ in range(20)))
    assert all("joined" in names(r) for r in results)
    assert lister.calls == 2, "twenty first passes at once: one LIST"
    clock.now += FRESH_SHARE_SECONDS / 2
    await view.nodes(lister, fresh=True)
    assert lister.calls == 2, "within FRESH_SHARE_SECONDS of a LIST: shared"


@pytest.mark.asyncio
async def test_a_relist_after_a_watch_gap_drops_nodes_deleted_in_the_gap() -> None:
    clock = Clock()
    nodes = [versioned(n, 10 + i) for i, n in enumerate(cluster_a())]
    lister, view = Lister(nodes), NodeView(clock=clock)
    await view.nodes(lister)
    # The watch expires (410 Gone); a-l4 is deleted meanwhile; kopf re-lists the others with
    # type None events and sends no DELETED for a-l4.
    del lister.nodes["a-l4"]
    clock.now += RELIST_GAP_SECONDS + 1
    for node in lister.nodes.values():
        view.apply(None, node)
    assert view.needs_list()
    assert "a-l4" not in names(await view.nodes(lister)) and lister.calls == 2
    # More events of that same listing do not ask for yet another LIST.
    view.apply(None, lister.nodes["b-p40"])
    assert not view.needs_list()


@pytest.mark.asyncio
async def test_events_during_a_list_win_when_newer_and_lose_when_older() -> None:
    lister = Lister([versioned(gpu_node("old", "NVIDIA-L4", 2), 5),
                     versioned(gpu_node("gone", "NVIDIA-L4", 2), 5),
                     versioned(gpu_node("kept", "NVIDIA-L4", 2), 9)])
    view = NodeView()

    def meanwhile() -> None:  # watch events that arrive while the LIST reply is in flight
        view.apply("MODIFIED", versioned(gpu_node("old", "NVIDIA-L4", 2, unschedulable=True), 6))
        view.apply("DELETED", versioned(gpu_node("gone", "NVIDIA-L4", 2), 7))
        view.apply("MODIFIED", versioned(gpu_node("kept", "NVIDIA-L4", 1), 8))  # older
        view.apply("ADDED", versioned(gpu_node("new", "NVIDIA-L4", 2), 10))
    lister.during = meanwhile
    nodes = {n["metadata"]["name"]: n for n in await view.nodes(lister)}
    assert sorted(nodes) == ["kept", "new", "old"]
    assert nodes["old"]["spec"] == {"unschedulable": True}
    assert nodes["kept"]["status"]["allocatable"]["nvidia.com/gpu"] == "2"


@pytest.mark.asyncio
async def test_resync_after_its_period_and_retry_after_a_failed_list() -> None:
    clock = Clock()
    lister, view = Lister(cluster_a()), NodeView(resync_seconds=300, clock=clock)
    await view.nodes(lister)
    clock.now += 299
    await view.nodes(lister)
    assert lister.calls == 1
    clock.now += 2
    lister.fail = True
    with pytest.raises(ConnectionError):
        await view.nodes(lister)
    lister.fail = False
    await view.nodes(lister)
    assert lister.calls == 3 and not view.needs_list()


def test_which_jobs_a_node_change_wakes() -> None:
    matters = handlers.node_change_matters
    running = handlers.pools_in_use({"phase": "Running", "plan": {"pools": {"Tesla-P40": 3}}})
    assert running == {"Tesla-P40": 3}
    assert matters(running, {"Tesla-P40", "NVIDIA-L4"}, {"Tesla-P40": 2}), "lost GPUs: re-plan"
    assert not matters(running, {"Tesla-P40"}, {"Tesla-P40": 3}), "still fits: nothing to do"
    assert not matters(running, {"NVIDIA-L4"}, {"Tesla-P40": 0}), "not a pool it uses"
    assert matters(running, {"Tesla-P40"}, None), "view not primed: wake to be safe"
    waiting = handlers.pools_in_use({"phase": "Pending", "message": "waiting for GPUs"})
    assert waiting is None and matters(waiting, {"NVIDIA-L4"}, {"NVIDIA-L4": 8})
    replanning = handlers.pools_in_use({"phase": "Planning", "plan": {"pools": {"A": 1}}})
    assert replanning is None
    for phase in ("Succeeded", "Failed", "Suspended"):
        assert not matters(handlers.pools_in_use({"phase": phase}), {"A"}, {"A": 0})


@pytest.mark.asyncio
async def test_a_burst_of_node_events_wakes_each_affected_job_once(monkeypatch) -> None:
    # The view says Tesla-P40 has 3 usable GPUs now: the job using 4 must re-plan.
    monkeypatch.setattr(handlers.NODES, "pool_gpus", lambda: {"Tesla-P40": 3, "NVIDIA-L4": 2})
    jobs = {("ns", "p40"): {"Tesla-P40": 4}, ("ns", "p40-fits"): {"Tesla-P40": 3},
            ("ns", "l4"): {"NVIDIA-L4": 4}, ("ns", "waiting"): None, ("ns", "done"): {}}
    wakeups = {key: asyncio.Event() for key in jobs}
    monkeypatch.setattr(handlers, "_wakeups", wakeups)
    monkeypatch.setattr(handlers, "_job_pools", dict(jobs))
    woken: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers, "_wake", lambda ns, name: woken.append((ns, name)))
    for _ in range(100):
        handlers._schedule_node_wake({"Tesla-P40"}, 0.05)
    assert woken == [], "nothing is sent before the debounce window closes"
    for _ in range(200):  # a hang guard, not a timing assertion
        if woken:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    assert sorted(woken) == [("ns", "p40"), ("ns", "waiting")]
    assert handlers._node_wake is None and not handlers._changed_products
