"""Leader election on a `coordination.k8s.io/v1` Lease: the pure decisions (no I/O, no clock).

The semantics are client-go's (k8s.io/client-go/tools/leaderelection):

* The Lease's spec is the record: `holderIdentity`, `leaseDurationSeconds`, `acquireTime`,
  `renewTime`, `leaseTransitions`. Every write is a PUT carrying the `resourceVersion` that
  was read (a create for a missing Lease), so of two candidates writing from the same read
  the API server accepts one and answers 409 Conflict to the other: never two holders.
* A candidate never trusts the timestamps written by another machine (clock skew): it
  remembers when *it* first saw the current record, by its own monotonic clock, and takes
  the Lease only once that record stayed unchanged for `leaseDurationSeconds`.
* The holder renews every `retry_period_seconds`; if no renewal has succeeded for
  `renew_deadline_seconds` (counted from when the last successful renewal was *sent*) it
  stops. As `renew_deadline < lease_duration`, it stops before any candidate can see its
  record as expired: a standby that takes over after `lease_duration` of silence never
  overlaps the old leader (given clocks that run at about the same rate, as client-go
  assumes).
* An empty `holderIdentity` is a released Lease (a leader that shut down cleanly): it may be
  taken at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

LEASE_API = "/apis/coordination.k8s.io/v1"
# client-go's JitterFactor: a renewal period may stretch by this factor under load, so the
# renew deadline must leave room for at least one late retry.
JITTER_FACTOR = 1.2


def lease_path(namespace: str, name: str | None = None) -> str:
    return f"{LEASE_API}/namespaces/{namespace}/leases" + (f"/{name}" if name else "")


@dataclass(frozen=True)
class ElectionTiming:
    """client-go's three durations (its defaults: 15 s, 10 s, 2 s)."""

    lease_duration_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0

    def problem(self) -> str | None:
        """Why these durations cannot guarantee one leader (None: they can)."""
        if not self.lease_duration_seconds > self.renew_deadline_seconds:
            return (f"the lease duration ({self.lease_duration_seconds:g} s) must be longer "
                    f"than the renew deadline ({self.renew_deadline_seconds:g} s)")
        if not self.renew_deadline_seconds > JITTER_FACTOR * self.retry_period_seconds:
            return (f"the renew deadline ({self.renew_deadline_seconds:g} s) must be longer "
                    f"than {JITTER_FACTOR:g} x the retry period "
                    f"({self.retry_period_seconds:g} s)")
        if self.retry_period_seconds <= 0:
            return "the retry period must be > 0 s"
        if self.lease_duration_seconds != int(self.lease_duration_seconds):
            return "the lease duration must be whole seconds (leaseDurationSeconds is int32)"
        return None


@dataclass(frozen=True)
class Record:
    """A Lease's spec, as the election reads it."""

    holder: str  # "" when nobody holds it (released)
    lease_duration_seconds: int
    acquire_time: str | None  # RFC 3339 with microseconds (MicroTime), as stored
    renew_time: str | None
    transitions: int

    @classmethod
    def of(cls, lease: dict[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(holder=str(spec.get("holderIdentity") or ""),
                   lease_duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
                   acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                   transitions=int(spec.get("leaseTransitions") or 0))

    def spec(self) -> dict[str, Any]:
        return {"holderIdentity": self.holder or None,
                "leaseDurationSeconds": self.lease_duration_seconds,
                "acquireTime": self.acquire_time, "renewTime": self.renew_time,
                "leaseTransitions": self.transitions}


@dataclass(frozen=True)
class Observation:
    """The last record a candidate saw and when it first saw it (its monotonic clock)."""

    record: Record
    seen_at_seconds: float


class Action(enum.Enum):
    CREATE = "create"  # no Lease yet: POST one naming us
    ACQUIRE = "acquire"  # released or expired: PUT us as the holder (a transition)
    RENEW = "renew"  # we hold it: PUT a fresh renewTime
    WAIT = "wait"  # someone else holds a live Lease


@dataclass(frozen=True)
class Decision:
    action: Action
    record: Record | None  # what to write (None for WAIT)
    observation: Observation | None  # what to remember for the next decision
    reason: str


def micro_time(now: datetime) -> str:
    """A MicroTime as the API server stores it: UTC, microseconds, `Z`."""
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def decide(lease: dict[str, Any] | None, last: Observation | None, me: str,
           now_seconds: float, now_wall: datetime, timing: ElectionTiming) -> Decision:
    """What candidate `me` does with the Lease it just read (None: there is none).

    `now_seconds` is its monotonic clock (expiry is judged by it alone); `now_wall` only goes
    into the timestamps it writes, for people and other tools to read."""
    stamp = micro_time(now_wall)
    duration = int(timing.lease_duration_seconds)
    if lease is None:
        mine = Record(me, duration, stamp, stamp, 0)
        return Decision(Action.CREATE, mine, None, "no Lease yet")
    record = Record.of(lease)
    seen = last if last is not None and last.record == record else Observation(record,
                                                                                now_seconds)
    if record.holder == me:
        renewed = replace(record, lease_duration_seconds=duration, renew_time=stamp)
        return Decision(Action.RENEW, renewed, seen, "we hold it")
    taken = Record(me, duration, stamp, stamp, record.transitions + 1)
    if not record.holder:
        return Decision(Action.ACQUIRE, taken, seen, "released by its last holder")
    silent = now_seconds - seen.seen_at_seconds
    # The holder's own duration counts (a leader configured with a longer lease than ours
    # must not be cut short); a record without one gets ours.
    expires = record.lease_duration_seconds or duration
    if silent < expires:
        return Decision(Action.WAIT, None, seen,
                        f"held by {record.holder}; unchanged for {silent:.1f} s of {expires} s")
    return Decision(Action.ACQUIRE, taken, seen,
                    f"{record.holder} did not renew for {silent:.1f} s (lease {expires} s)")


def lease_body(namespace: str, name: str, record: Record,
               resource_version: str | None) -> dict[str, Any]:
    """The Lease to POST (no resourceVersion) or PUT (the one read: optimistic concurrency)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": record.spec()}


class Term:
    """The leader's side of the deadline: when it must stop if renewals keep failing."""

    def __init__(self, timing: ElectionTiming, sent_at_seconds: float) -> None:
        self.timing = timing
        self.renewed_sent_at_seconds = sent_at_seconds

    def renewed(self, sent_at_seconds: float) -> None:
        """A renewal sent at `sent_at_seconds` succeeded (the send time, not the reply's:
        the server may have stored it at any moment in between)."""
        self.renewed_sent_at_seconds = max(self.renewed_sent_at_seconds, sent_at_seconds)

    def deadline_seconds(self) -> float:
        return self.renewed_sent_at_seconds + self.timing.renew_deadline_seconds

    def must_stop(self, now_seconds: float) -> bool:
        return now_seconds >= self.deadline_seconds()
