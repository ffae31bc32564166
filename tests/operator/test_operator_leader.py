"""The leader election's I/O shell (cephalo.operator.leader) over an in-memory Lease store
that answers as the API server does (404, 409 AlreadyExists, 409 Conflict on a stale
resourceVersion): races, release, and the exit of a leader that cannot renew. The real
kube-apiserver's side is tests/realk8s/test_operator_leader.py."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf
import pytest

from cephalo.operator import leader as leader_module
from cephalo.operator import metrics
from cephalo.operator.kube import ApiError
from cephalo.operator.leader import Elector, Probes
from cephalo.operator.lease import Action, ElectionTiming, lease_path

NS, NAME = "cephalo-system", "cephalo-operator"
TIMING = ElectionTiming(lease_duration_seconds=2, renew_deadline_seconds=1.0,
                        retry_period_seconds=0.2)


class LeaseStore:
    """One Lease with the API server's write rules; `down` makes every request fail."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.before_write: Callable[[], None] | None = None  # a concurrent writer's turn

    def request(self, method: str, path: str, body: Any = None,
                timeout_seconds: float = 30) -> dict[str, Any]:
        assert path in (lease_path(NS), lease_path(NS, NAME)), path
        if self.down:
            raise ApiError(503, "ServiceUnavailable", "the API server is away")
        if method == "GET":
            if self.lease is None:
                raise ApiError(404, "NotFound", "leases.coordination.k8s.io not found")
            return copy.deepcopy(self.lease)
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            hook()
        if method == "POST" and self.lease is not None:
            raise ApiError(409, "AlreadyExists", "already exists")
        if method == "PUT" and (self.lease is None or body["metadata"]["resourceVersion"]
                                != self.lease["metadata"]["resourceVersion"]):
            raise ApiError(409, "Conflict", "the object has been modified")
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    def holder(self) -> str | None:
        return None if self.lease is None else self.lease["spec"]["holderIdentity"]


def _elector(store: LeaseStore, me: str) -> Elector:
    return Elector(store, NS, NAME, TIMING, me=me)  # type: ignore[arg-type]


def test_one_creates_the_other_waits_the_holder_renews() -> None:
    store = LeaseStore()
    a, b = _elector(store, "a"), _elector(store, "b")
    assert a.try_once() is Action.CREATE and store.holder() == "a"
    assert b.try_once() is Action.WAIT and store.holder() == "a"
    version = store.version
    assert a.try_once() is Action.RENEW and store.version == version + 1
    assert store.lease is not None and store.lease["spec"]["leaseTransitions"] == 0


def test_of_two_writes_from_one_read_the_second_loses() -> None:
    store = LeaseStore()
    a, b = _elector(store, "a"), _elector(store, "b")
    assert a.acquire()
    a.release()  # empty holder: both may take it at once
    # b read the released Lease; before its PUT lands, c takes it (a newer resourceVersion).
    c = _elector(store, "c")

    def c_first() -> None:
        assert c.try_once() is Action.ACQUIRE
    store.before_write = c_first
    assert b.try_once() is Action.WAIT
    assert store.holder() == "c" and b.term is None


def test_a_release_lets_the_standby_take_over_at_once() -> None:
    store = LeaseStore()
    a, b = _elector(store, "a"), _elector(store, "b")
    assert a.acquire() and a.leading.is_set() and metrics.LEADER._value.get() == 1
    assert b.try_once() is Action.WAIT
    a.release()
    assert store.holder() is None and not a.leading.is_set()
    assert metrics.LEADER._value.get() == 0
    assert b.try_once() is Action.ACQUIRE and store.holder() == "b"
    assert store.lease is not None and store.lease["spec"]["leaseTransitions"] == 1


def test_a_leader_that_cannot_renew_exits_before_the_lease_runs_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = LeaseStore()
    exited = threading.Event()
    monkeypatch.setattr(leader_module.os, "_exit", lambda code: exited.set())
    a = _elector(store, "a")
    assert a.acquire()
    acquired = time.monotonic()
    store.down = True  # the API server unreachable from the leader
    a.keep()
    assert exited.wait(10), "the watchdog never ended the process"
    waited = time.monotonic() - acquired
    assert TIMING.renew_deadline_seconds <= waited < TIMING.lease_duration_seconds, waited
    a.stopping.set()


def test_a_leader_that_sees_another_holder_exits_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = LeaseStore()
    exited = threading.Event()
    monkeypatch.setattr(leader_module.os, "_exit", lambda code: exited.set())
    a = _elector(store, "a")
    assert a.acquire()
    assert store.lease is not None
    store.lease["spec"]["holderIdentity"] = "intruder"  # e.g. an admin's edit
    a.keep()
    assert exited.wait(5)
    a.stopping.set()


def test_probes_say_alive_on_both_and_ready_on_the_leader_only() -> None:
    store = LeaseStore()
    a = _elector(store, "a")
    probes = Probes(a, 0)
    try:
        assert probes.answer("/healthz") == (200, "standby\n")
        assert probes.answer("/readyz")[0] == 503
        a.acquire()
        assert probes.answer("/readyz")[0] == 503  # kopf's handlers not started yet
        probes.ready.set()
        assert probes.answer("/readyz") == (200, "leader\n")
        probes.loop_turned_at -= leader_module.LOOP_STALL_SECONDS + 1
        assert probes.answer("/healthz")[0] == 500
    finally:
        probes.server.shutdown()
        a.stopping.set()


@pytest.mark.asyncio
async def test_cleanup_hands_the_lease_over_and_ends_the_probes_heartbeat() -> None:
    """At shutdown kopf waits up to 5 s for any task still on its loop before the process
    exits: the probes' heartbeat (Probes.tick, a task that never ends by itself) made every
    chart-started leader take 5 s to stop on SIGTERM (the chart RBAC test's operators were
    SIGKILLed after 5 s). kopf's cleanup handler ends it once the lease is handed over."""
    from cephalo.operator import handlers

    store = LeaseStore()
    a = _elector(store, "a")
    assert a.acquire()
    probes = Probes(a, 0)
    a.tick = asyncio.get_running_loop().create_task(probes.tick())
    try:
        await handlers.cleanup(memo=kopf.Memo(elector=a))
        assert store.holder() is None and not a.leading.is_set()
        await asyncio.sleep(0)  # one turn of the loop: a cancelled task ends in it
        assert a.tick.done(), "the probes' heartbeat still runs: kopf waits 5 s for it"
    finally:
        a.tick.cancel()
        probes.server.shutdown()
        a.stopping.set()
