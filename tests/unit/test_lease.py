"""Leader election's pure decisions (cephalo.operator.lease) under a fake clock.

First each rule on its own; then the safety property the rules exist for, checked over many
seeded schedules: candidates that read and write a Lease store with optimistic concurrency
(409 on a stale resourceVersion, as the API server answers), with request delays, leaders
SIGKILLed or cut off from the API server, never have two terms active at one instant, and a
killed leader is replaced within lease duration + retry period + the requests' delays.
(tests/realk8s/test_operator_leader.py checks the same against a real kube-apiserver.)
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from cephalo.operator.lease import (
    Action,
    ElectionTiming,
    Observation,
    Record,
    Term,
    decide,
    lease_body,
    micro_time,
)

T = ElectionTiming(lease_duration_seconds=15, renew_deadline_seconds=10,
                   retry_period_seconds=2)
WALL = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)


def lease(holder: str | None, *, renew: str = "2020-01-01T00:00:00.000000Z",
          transitions: int = 3, duration: int = 15, rv: str = "7") -> dict[str, Any]:
    return lease_body("ns", "l", Record(holder or "", duration, "2019-12-31T00:00:00.000000Z",
                                        renew, transitions), rv)


def test_no_lease_creates_one_naming_us() -> None:
    d = decide(None, None, "me", 100.0, WALL, T)
    assert d.action is Action.CREATE and d.observation is None
    assert d.record == Record("me", 15, "2026-01-02T03:04:05.678901Z",
                              "2026-01-02T03:04:05.678901Z", 0)
    body = lease_body("ns", "l", d.record, None)
    assert "resourceVersion" not in body["metadata"]
    assert body["spec"]["holderIdentity"] == "me"


def test_our_lease_is_renewed_keeping_acquire_time_and_transitions() -> None:
    d = decide(lease("me"), None, "me", 5.0, WALL, T)
    assert d.action is Action.RENEW and d.record is not None
    assert d.record.renew_time == micro_time(WALL)
    assert (d.record.acquire_time, d.record.transitions) == ("2019-12-31T00:00:00.000000Z", 3)
    assert lease_body("ns", "l", d.record, "7")["metadata"]["resourceVersion"] == "7"


def test_a_released_lease_is_taken_at_once_as_a_transition() -> None:
    d = decide(lease(None), None, "me", 0.0, WALL, T)
    assert d.action is Action.ACQUIRE and d.record is not None
    assert (d.record.holder, d.record.transitions) == ("me", 4)
    assert d.record.acquire_time == d.record.renew_time == micro_time(WALL)


def test_another_holder_is_waited_out_by_our_clock_not_its_timestamps() -> None:
    # renewTime years ago (a skewed clock, or an old record): no matter, the record must
    # stay unchanged for the lease duration *as we observe it*.
    first = decide(lease("other"), None, "me", 100.0, WALL, T)
    assert first.action is Action.WAIT and first.observation == Observation(
        Record.of(lease("other")), 100.0)
    almost = decide(lease("other"), first.observation, "me", 114.99, WALL, T)
    assert almost.action is Action.WAIT and almost.observation == first.observation
    due = decide(lease("other"), almost.observation, "me", 115.0, WALL, T)
    assert due.action is Action.ACQUIRE and due.record is not None
    assert (due.record.holder, due.record.transitions) == ("me", 4)


def test_a_renewal_restarts_the_wait() -> None:
    first = decide(lease("other"), None, "me", 0.0, WALL, T)
    renewed = lease("other", renew="2020-01-01T00:00:02.000000Z")
    second = decide(renewed, first.observation, "me", 14.0, WALL, T)
    assert second.action is Action.WAIT and second.observation is not None
    assert second.observation.seen_at_seconds == 14.0
    assert decide(renewed, second.observation, "me", 28.9, WALL, T).action is Action.WAIT
    assert decide(renewed, second.observation, "me", 29.0, WALL, T).action is Action.ACQUIRE


def test_the_holders_longer_lease_duration_is_honoured() -> None:
    long = lease("other", duration=60)
    first = decide(long, None, "me", 0.0, WALL, T)
    assert decide(long, first.observation, "me", 59.0, WALL, T).action is Action.WAIT
    assert decide(long, first.observation, "me", 60.0, WALL, T).action is Action.ACQUIRE


def test_term_ends_at_the_renew_deadline_from_the_last_renewal_sent() -> None:
    term = Term(T, sent_at_seconds=10.0)
    assert not term.must_stop(19.99) and term.must_stop(20.0)
    term.renewed(sent_at_seconds=12.0)
    term.renewed(sent_at_seconds=11.0)  # a reply out of order never moves it back
    assert term.deadline_seconds() == 22.0


@pytest.mark.parametrize(("timing", "problem"), [
    (ElectionTiming(10, 10, 2), "lease duration (10 s) must be longer than the renew"),
    (ElectionTiming(15, 2.4, 2), "renew deadline (2.4 s) must be longer than 1.2 x"),
    (ElectionTiming(15.5, 10, 2), "whole seconds"),
    (ElectionTiming(15, 10, 0), "retry period must be > 0"),
])
def test_timings_that_cannot_keep_one_leader_are_refused(timing: ElectionTiming,
                                                         problem: str) -> None:
    assert problem in (timing.problem() or "")
    assert ElectionTiming().problem() is None


# ---- the safety property over seeded schedules ---------------------------------------------

@dataclass
class Store:
    """The API server's side: one Lease, a resourceVersion, 409 on a stale write."""
    lease: dict[str, Any] | None = None
    version: int = 0

    def write(self, body: dict[str, Any], create: bool) -> bool:
        if create != (self.lease is None) or (
                not create and body["metadata"]["resourceVersion"] != str(self.version)):
            return False
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"],
                                           "resourceVersion": str(self.version)}}
        return True


@dataclass
class Candidate:
    name: str
    seen: Observation | None = None
    term: Term | None = None
    dead_at: float = float("inf")  # SIGKILL
    cut_off: tuple[float, float] = (0.0, 0.0)  # requests fail in [start, end)
    active: list[tuple[float, float]] = field(default_factory=list)  # [began, ended)

    def reachable(self, now: float) -> bool:
        return not self.cut_off[0] <= now < self.cut_off[1]


def simulate(seed: int, candidates: int = 3, horizon: float = 600.0) -> list[Candidate]:
    rng = random.Random(seed)
    store = Store()
    cands = [Candidate(f"c{i}") for i in range(candidates)]
    # Each candidate: GET at t, its reply at t + d1 (decided then), the write stored at
    # t + d1 + d2, the write's reply at t + d1 + 2 d2; next try a retry period after t.
    events: list[tuple[float, int, str, int, Any]] = []
    order = iter(range(10**9))
    for i in range(candidates):
        heapq.heappush(events, (rng.uniform(0, 2), next(order), "get", i, None))
    kills = sorted(rng.uniform(10, horizon - 60) for _ in range(8))
    while events:
        now, _, kind, i, payload = heapq.heappop(events)
        c = cands[i]
        if now >= min(c.dead_at, horizon):
            continue
        if c.term is not None and c.term.must_stop(now):  # the watchdog: exit at the deadline
            c.active[-1] = (c.active[-1][0], c.term.deadline_seconds())
            c.dead_at = c.term.deadline_seconds()
            continue
        if kills and now >= kills[0]:  # kill or cut off whoever leads now
            kills.pop(0)
            for other in cands:
                if other.term is not None and other.dead_at == float("inf"):
                    if rng.random() < 0.5:
                        other.dead_at = now
                        other.active[-1] = (other.active[-1][0], now)
                    else:
                        other.cut_off = (now, now + rng.uniform(5, 30))
            cands.append(Candidate(f"c{len(cands)}"))  # the Deployment's replacement
            heapq.heappush(events, (now + rng.uniform(1, 5), next(order), "get",
                                    len(cands) - 1, None))
        if kind == "get":
            nxt = now + T.retry_period_seconds * rng.uniform(1, 1.2)
            heapq.heappush(events, (nxt, next(order), "get", i, None))
            if c.reachable(now):
                snapshot = None if store.lease is None else dict(store.lease)
                heapq.heappush(events, (now + rng.uniform(0, 0.5), next(order), "decide", i,
                                        (now, snapshot)))
        elif kind == "decide":
            sent, snapshot = payload
            d = decide(snapshot, c.seen, c.name, now, WALL + timedelta(seconds=now), T)
            c.seen = d.observation
            if d.action is not Action.WAIT and d.record is not None:
                rv = None if snapshot is None else snapshot["metadata"]["resourceVersion"]
                body = lease_body("ns", "l", d.record, rv)
                heapq.heappush(events, (now + rng.uniform(0, 0.5), next(order), "store", i,
                                        (sent, body, d.action is Action.CREATE)))
        elif kind == "store":
            sent, body, create = payload
            if c.reachable(now) and store.write(body, create):
                heapq.heappush(events, (now + rng.uniform(0, 0.5), next(order), "reply", i,
                                        sent))
        elif kind == "reply":
            if c.term is None:
                c.term = Term(T, payload)
                c.active.append((now, float("inf")))
            else:
                c.term.renewed(payload)
    for c in cands:
        if c.active and c.active[-1][1] == float("inf"):
            c.active[-1] = (c.active[-1][0], min(c.dead_at, horizon))
    return cands


@pytest.mark.parametrize("seed", range(200))
def test_never_two_active_leaders_and_a_killed_one_is_replaced(seed: int) -> None:
    cands = simulate(seed)
    terms = sorted((began, ended, c.name) for c in cands for began, ended in c.active)
    assert terms, "nobody ever led"
    for (_, e1, n1), (b2, _, n2) in itertools.pairwise(terms):
        assert e1 <= b2, f"{n1} active until {e1:.2f} s, {n2} from {b2:.2f} s"
        # Liveness: the next term starts within the lease + two retry periods (one to see
        # the last renewal, one to act after the lease ran out; x1.2 jitter) + 4 delays.
        bound = T.lease_duration_seconds + 2 * T.retry_period_seconds * 1.2 + 4 * 0.5
        assert b2 - e1 <= bound, (n1, e1, n2, b2)
